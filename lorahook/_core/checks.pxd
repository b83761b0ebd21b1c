# cython: language_level=3
# The call checks every entry point into the kernels runs first, with the GIL.
cimport numpy as cnp

# The dtypes rows may have (bfloat16 is ml_dtypes' numpy dtype).
cdef enum:
    ROWS_F32 = 0
    ROWS_F16 = 1
    ROWS_BF16 = 2

cdef str shape_str(cnp.ndarray arr)
cdef int check_type(object arr, str name, int bits=*) except -1
cdef int check_types(object input, object output, int bits=*) except -1
cdef int check_layout(cnp.ndarray a, str name, bint writable) except -1
cdef object as_int(object v, str name)
cdef Py_ssize_t as_width(object w, str name) except -1
cdef Py_ssize_t row_count(cnp.ndarray a, Py_ssize_t width, str name, str wname) except -1
cdef int refuse_overlap(cnp.ndarray x, cnp.ndarray y, str xname=*, str yname=*) except -1
cdef Py_ssize_t check_call(object input, object output, object input_row_width,
                           object output_row_width, Py_ssize_t *widths=*, int *kind=*,
                           int bits=*, object float32_only=*) except -1
cdef int check_buffers(object input, object output, Py_ssize_t n, Py_ssize_t d_in,
                       Py_ssize_t d_out) except -1
