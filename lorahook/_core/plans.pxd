# cython: language_level=3
# Layer kernels (see plans.pyx): adapter layers as typed views, and plans
# of them over a batch.  Shared with lorahook._rows (the hook interface) and
# lorahook._testing.
cimport numpy as cnp

from lorahook._core.gemm_rows cimport Segment

cdef class LayerKernel:
    """The compiled view of one validated adapter layer (read-only arrays)."""
    cdef const float[:, ::1] a    # (rank, d_in)
    cdef const float[:, ::1] bt   # B^T, (rank, d_out) C-contiguous: the one layout of B
    cdef const unsigned short[:, ::1] a16   # a and bt as 16-bit patterns (half weights)
    cdef const unsigned short[:, ::1] bt16
    cdef const unsigned short[::1] bias16
    cdef const signed char[:, ::1] a8    # a and bt in int8 (int8 weights), with
    cdef const signed char[:, ::1] bt8
    cdef const float[::1] a_scale        # a scale per row of a and
    cdef const float[::1] b_scale        # one per output (per column of bt)
    cdef int wkind                 # WKIND_F32, WKIND_INT8 or the halfconv.h kind (gemm_rows.pxd)
    cdef const float[::1] bias
    cdef readonly int rank
    cdef readonly int d_in
    cdef readonly int d_out
    cdef readonly float scale
    cdef bint has_bias
    cdef readonly int kind         # KIND_LORA, KIND_EMBEDDING, KIND_SAVED_LINEAR, KIND_SAVED_EMBEDDING
    cdef readonly bint needs_base  # a DoRA layer without its base weight: refused before any write
    cdef int pre                   # a PRE_* value (gemm_rows.pxd)
    cdef bint has_pre_add
    cdef const float[::1] pre_mul
    cdef const float[::1] pre_add

    cdef void fill(self, Segment *s) noexcept


# What a layer kernel computes (LayerKernel.kind).
cdef enum:
    KIND_LORA = 0             # y += s * B (A x)  (DoRA: y = g*y + c first, B holding g*B)
    KIND_EMBEDDING = 1        # y += s * B A[:, id]
    KIND_SAVED_LINEAR = 2     # y = W x + b: a module saved whole replaces the base output
    KIND_SAVED_EMBEDDING = 3  # y = E[id]


cdef class GroupPlan:
    cdef bint _embedding      # a plan of embedding kernels (run with ids)
    cdef object _owned        # the private copies the segments point into
    cdef object _segs_obj     # bytearray of Segment
    cdef Segment *_segs
    cdef Py_ssize_t _ng
    cdef readonly Py_ssize_t n_rows
    cdef readonly int d_in
    cdef readonly int d_out

    cdef int run(self, cnp.ndarray x, cnp.ndarray y, int kind) except -1
    cdef int run_ids(self, cnp.ndarray ids, cnp.ndarray y, int kind) except -1


cdef int run_layer(LayerKernel layer, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_rows,
                   int kind) except -1
cdef object private_vector(object obj, int typenum, object dtype, str where, str what,
                           str kind)
