# cython: language_level=3
# Half-precision conversions and the instruction-set target: lorahook._core.halfconv owns
# the target (isa.h); every compiled module attaches to it at import (attach_isa below) and
# converts with halfconv.h's lorahook_half_widen / lorahook_half_narrow, which read it.
cimport numpy as cnp
from libc.stdint cimport uint16_t

cdef extern from "isa.h" nogil:
    void lh_isa_attach(const int *cell) noexcept
    int lh_isa_active() noexcept

cdef extern from "halfconv.h" nogil:
    int LORAHOOK_HALF_F16
    int LORAHOOK_HALF_BF16
    # conversions inline, on the process's target
    void widen_h "lorahook_half_widen" (const uint16_t *src, float *dst, size_t n, int kind) noexcept
    void narrow_h "lorahook_half_narrow" (const float *src, uint16_t *dst, size_t n, int kind) noexcept

cdef const int *isa_cell() noexcept nogil
cdef void widen_n(const uint16_t *src, float *dst, size_t n, int kind) noexcept nogil
cdef void narrow_n(const float *src, uint16_t *dst, size_t n, int kind) noexcept nogil
cdef int half_kind(object kind) except -1
cdef cnp.ndarray half_array(object arr, object dtype, str name)
