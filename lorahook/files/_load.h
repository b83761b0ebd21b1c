/* Loading tensors: moving float32 values from a file's layout into an adapter's.
 *
 *   size_t lorahook_count_nonfinite(const float *x, size_t n);
 *   void   lorahook_transpose(const float *src, size_t rows, size_t cols,
 *                             float *dst, size_t ld);
 *   void   lorahook_advise_hugepages(void *p, size_t n);
 *
 * lorahook_count_nonfinite counts NaNs and infinities by their bits (an
 * exponent of all ones), so the floating-point environment cannot change it.
 * lorahook_transpose writes the row-major (rows, cols) block src into the
 * columns of dst: dst[j * ld + i] = src[i * cols + j], with ld >= rows.  Its
 * stores may bypass the cache (see below); it ends with a store fence then.
 *
 * Both are static, allocate nothing and touch no Python object, so they may be
 * called without the GIL.  The AVX2 paths are compiled for their own target
 * and run from the "avx2" target up (isa.h; include halfconv.h first).
 */
#ifndef LORAHOOK_LOAD_H
#define LORAHOOK_LOAD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#ifndef LORAHOOK_HALF_H
#error "include halfconv.h before _load.h"
#endif

#if LORAHOOK_HALF_X86
#include <immintrin.h>
#endif

/* Advise the whole pages of [p, p + n) as huge pages where the OS has such
   advice (Linux); only advice: nothing happens when it is refused. */
LORAHOOK_HALF_FN void lorahook_advise_hugepages(void *p, size_t n) {
#ifdef MADV_HUGEPAGE
    uintptr_t first = ((uintptr_t)p + 4095) & ~(uintptr_t)4095;
    uintptr_t last = ((uintptr_t)p + n) & ~(uintptr_t)4095;
    if (last > first)
        (void)madvise((void *)first, last - first, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

LORAHOOK_HALF_FN size_t lorahook_count_nonfinite_portable(const float *x, size_t n) {
    size_t i, bad = 0;
    uint32_t u;
    for (i = 0; i < n; i++) {
        memcpy(&u, x + i, sizeof u);
        bad += (u & 0x7F800000u) == 0x7F800000u;
    }
    return bad;
}

#if LORAHOOK_HALF_X86
/* Only whether anything is not finite is found at full speed: the largest
   magnitude (as bits) of each block of 64 values is compared with infinity's,
   and a block with a hit is counted exactly by the portable loop. */
__attribute__((target("avx2")))
LORAHOOK_HALF_FN size_t lorahook_count_nonfinite_avx2(const float *x, size_t n) {
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i limit = _mm256_set1_epi32(0x7F7FFFFF); /* largest finite magnitude */
    size_t i = 0, bad = 0;
    for (; i + 64 <= n; i += 64) {
        __m256i m = _mm256_setzero_si256();
        int k;
        for (k = 0; k < 64; k += 8)
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + k)), absmask));
        /* every lane is below 2**31, so the signed compare is the unsigned one */
        if (!_mm256_testz_si256(_mm256_cmpgt_epi32(m, limit), _mm256_cmpgt_epi32(m, limit)))
            bad += lorahook_count_nonfinite_portable(x + i, 64);
    }
    _mm256_zeroupper();
    return bad + lorahook_count_nonfinite_portable(x + i, n - i);
}
#endif

/* On the process's target (isa.h): AVX2 code from "avx2" up, else portable. */
LORAHOOK_HALF_FN size_t lorahook_count_nonfinite(const float *x, size_t n) {
#if LORAHOOK_HALF_X86
    if (lh_isa_active() >= LH_ISA_AVX2)
        return lorahook_count_nonfinite_avx2(x, n);
#endif
    return lorahook_count_nonfinite_portable(x, n);
}

/* Tiles of 4 x 4 with SSE (the x86-64 baseline), scalar edges.  Blocks of 16
   source rows are done four destination rows at a time, so that each of those
   rows gets a whole cache line before the next four are started: destination
   rows a multiple of 4 KiB apart share one L1 set, and sixteen lines filled a
   little at a time in one set would evict each other.  When every line the
   blocks write is a whole aligned cache line (dst and ld * 4 multiples of 64
   bytes), the stores bypass the cache: the destination is fresh memory the
   caller will not read soon, and a cached store would first read each line
   from memory. */
LORAHOOK_HALF_FN void lorahook_transpose(const float *src, size_t rows, size_t cols, float *dst, size_t ld) {
    size_t i0 = 0, i, j;
#if LORAHOOK_HALF_X86
    const int stream = (uintptr_t)dst % 64 == 0 && ld % 16 == 0;
    for (; i0 + 16 <= rows; i0 += 16) {
        for (j = 0; j + 4 <= cols; j += 4) {
            for (i = i0; i < i0 + 16; i += 4) {
                const float *s = src + i * cols + j;
                __m128 r0 = _mm_loadu_ps(s);
                __m128 r1 = _mm_loadu_ps(s + cols);
                __m128 r2 = _mm_loadu_ps(s + 2 * cols);
                __m128 r3 = _mm_loadu_ps(s + 3 * cols);
                _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
                if (stream) {
                    _mm_stream_ps(dst + j * ld + i, r0);
                    _mm_stream_ps(dst + (j + 1) * ld + i, r1);
                    _mm_stream_ps(dst + (j + 2) * ld + i, r2);
                    _mm_stream_ps(dst + (j + 3) * ld + i, r3);
                } else {
                    _mm_storeu_ps(dst + j * ld + i, r0);
                    _mm_storeu_ps(dst + (j + 1) * ld + i, r1);
                    _mm_storeu_ps(dst + (j + 2) * ld + i, r2);
                    _mm_storeu_ps(dst + (j + 3) * ld + i, r3);
                }
            }
        }
        for (; j < cols; j++)
            for (i = i0; i < i0 + 16; i++)
                dst[j * ld + i] = src[i * cols + j];
    }
    if (stream)
        _mm_sfence();  /* the streamed stores are visible before anything that follows */
#endif
    for (; i0 < rows; i0++)
        for (j = 0; j < cols; j++)
            dst[j * ld + i0] = src[i0 * cols + j];
}

#endif /* LORAHOOK_LOAD_H */
