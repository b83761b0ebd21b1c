# cython: language_level=3
# The segment kernels (see segments.pyx): what lorahook._core.plans runs its
# layers and plans with.
cimport numpy as cnp

from lorahook._core.gemm_rows cimport Segment


cdef int run_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray x, cnp.ndarray y,
                      int d_in, int d_out, int kind) except -1
cdef int run_embedding_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray ids,
                                cnp.ndarray y, int d_out, int kind) except -1
