# cython: language_level=3
# Half-precision conversions: lorahook._halfconv owns the choice of path (the
# state of _halfconv.h); other modules convert through the functions below.
cimport numpy as cnp
from libc.stdint cimport uint16_t

cdef extern from "_halfconv.h" nogil:
    int LORAHOOK_HALF_F16
    int LORAHOOK_HALF_BF16
    int LORAHOOK_HALF_PORTABLE
    int lorahook_half_supported() noexcept
    # inline conversions on a given path (the path itself is _halfconv's: active_path)
    void widen_on "lorahook_half_widen_on" (int path, const uint16_t *src, float *dst, size_t n,
                                            int kind) noexcept
    void narrow_on "lorahook_half_narrow_on" (int path, const float *src, uint16_t *dst,
                                              size_t n, int kind) noexcept

cdef int active_path() noexcept nogil
cdef void widen_n(const uint16_t *src, float *dst, size_t n, int kind) noexcept nogil
cdef void narrow_n(const float *src, uint16_t *dst, size_t n, int kind) noexcept nogil
cdef int half_kind(object kind) except -1
cdef cnp.ndarray half_array(object arr, object dtype, str name)
