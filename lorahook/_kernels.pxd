# cython: language_level=3
# The kernels: adapter layers as typed views, and the GIL-free row kernels
# that apply them to checked buffers.  Shared with lorahook._rows (the hook
# interface) and lorahook._testing.
cimport numpy as cnp

cdef struct Segment:
    # One adapter layer applied to a set of rows of one projection.
    const float *a          # (rank, d_in), row-major (NULL with 16-bit weights)
    const float *b          # B^T: (rank, d_out), row-major (B column-major)
    const unsigned short *a16   # the same as 16-bit patterns when wkind >= 0
    const unsigned short *b16
    int wkind               # -1: float32 weights; else the _halfconv.h kind of a16/b16
    const float *bias       # (d_out,) or NULL
    const unsigned short *bias16   # the bias as 16-bit patterns (wkind >= 0), or NULL
    int rank
    int d_in                # the layer's d_in (num_embeddings for an embedding)
    float scale             # used when row_scales is NULL
    const int *rows         # row indices, ascending; NULL means rows 0..n_rows-1
    const float *row_scales # one scale per entry of rows, or NULL
    Py_ssize_t n_rows
    int pre                 # before the delta, each output row y becomes: 0 y; 1 pre_mul*y + pre_add;
                            # 2 pre_add (zeros when NULL): the row is replaced
    const float *pre_mul    # (d_out,) or NULL
    const float *pre_add    # (d_out,) or NULL
    bint direct             # the product is x itself (A is the identity): b holds W^T, (d_in, d_out)


cdef class LayerKernel:
    """The compiled view of one validated adapter layer (read-only arrays)."""
    cdef const float[:, ::1] a    # (rank, d_in)
    cdef const float[:, ::1] bt   # B^T, (rank, d_out) C-contiguous: the one layout of B
    cdef const unsigned short[:, ::1] a16   # a and bt as 16-bit patterns (half weights)
    cdef const unsigned short[:, ::1] bt16
    cdef const unsigned short[::1] bias16
    cdef int wkind                 # -1: float32 weights; else the _halfconv.h kind
    cdef const float[::1] bias
    cdef readonly int rank
    cdef readonly int d_in
    cdef readonly int d_out
    cdef readonly float scale
    cdef bint has_bias
    cdef readonly int kind         # KIND_LORA, KIND_EMBEDDING, KIND_SAVED_LINEAR, KIND_SAVED_EMBEDDING
    cdef readonly bint needs_base  # a DoRA layer without its base weight: refused before any write
    cdef int pre
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
cdef int run_embedding_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray ids,
                                cnp.ndarray y, int d_out, int kind) except -1
cdef int run_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray x, cnp.ndarray y,
                      int d_in, int d_out, int kind) except -1
cdef object private_vector(object obj, int typenum, object dtype, str where, str what,
                           str kind)
