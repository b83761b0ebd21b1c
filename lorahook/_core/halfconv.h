/* Half-precision rows: float16 and bfloat16 to float32 and back.
 *
 * Half rows are handled as 16-bit patterns (uint16_t); nothing here needs a
 * compiler half type.  Every function is static, allocates nothing, takes no
 * lock and touches no Python object, so it may be called without the GIL.
 *
 *   void lorahook_half_widen(const uint16_t *src, float *dst, size_t n, int kind);
 *   void lorahook_half_narrow(const float *src, uint16_t *dst, size_t n, int kind);
 *
 * both on the process's instruction-set target (isa.h: lh_isa_active).
 *
 * kind is LORAHOOK_HALF_F16 or LORAHOOK_HALF_BF16.  src and dst must not
 * overlap.  A typical use widens input and output rows into float32 scratch,
 * lets BLAS add the delta to the widened output, and narrows it back once.
 *
 * The bit-level rules (the same bits on every target, for every input):
 *
 *   widen float16    exact.  Subnormals become normal float32 values.  A NaN
 *                    keeps its sign and payload (shifted left by 13) and is
 *                    made quiet: bits = sign | 0x7FC00000 | (mantissa << 13).
 *   widen bfloat16   exact, bits = (uint32_t)h << 16, NaNs included (a
 *                    signalling NaN stays signalling: bfloat16 is the top
 *                    half of a float32).
 *   narrow float16   round to nearest, ties to even, with float16 subnormals;
 *                    magnitudes of 65520 and more (the tie above 65504
 *                    goes to the even neighbour, inf) become +-inf; results
 *                    that round to zero keep their sign.
 *                    A NaN keeps its sign and the top 10 mantissa bits and
 *                    is made quiet: sign | 0x7E00 | ((bits >> 13) & 0x3FF).
 *   narrow bfloat16  round to nearest, ties to even, float32 subnormals
 *                    rounded like any other value (never flushed to zero);
 *                    values that round past the largest finite bfloat16
 *                    become +-inf.  A NaN keeps its sign and the top 7
 *                    mantissa bits and is made quiet: (bits >> 16) | 0x0040.
 *
 * These NaN rules are what the x86 instructions do (VCVTPH2PS, VCVTPS2PH,
 * VCVTNEPS2BF16); the portable code produces them too.  The portable code is
 * integer-only, so the floating-point environment (rounding mode,
 * flush-to-zero, denormals-are-zero) cannot change its results; the vector code
 * use explicit round-to-nearest-even, and VCVTNEPS2BF16's flushing of float32
 * subnormal inputs is corrected lane by lane.  Like any float32 arithmetic,
 * the F16C / AVX-512F float16 instructions may set the floating-point status
 * flags (inexact, overflow, underflow, invalid for signalling NaNs); they would
 * trap only in a host that unmasked floating-point exceptions.  The portable
 * code and the bfloat16 instructions set no flags.
 *
 * Code per target (isa.h): "avx512bf16" runs AVX-512 F/VL with AVX512_BF16
 * code (16 values a step), "avx2" and "avx512" run AVX2 + F16C code (8 values a
 * step), "portable" plain C, one value at a time.  The vector code is compiled
 * for its own target with __attribute__((target)).
 */
#ifndef LORAHOOK_HALF_H
#define LORAHOOK_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

#define LORAHOOK_HALF_X86 LH_ISA_X86

/* static functions a user of this header may leave unused without a warning */
#if defined(__GNUC__) || defined(__clang__)
#define LORAHOOK_HALF_FN static __attribute__((unused))
#else
#define LORAHOOK_HALF_FN static
#endif

#define LORAHOOK_HALF_F16 0
#define LORAHOOK_HALF_BF16 1


/* ------------------------------------------------------------------ */
/* Portable code: one value at a time, integer operations only.       */

static inline uint32_t lorahook_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float lorahook_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t lorahook_f16_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1Fu)  /* inf, or NaN made quiet */
        return sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0u);
    if (exp != 0)      /* normal: rebias 15 -> 127 */
        return sign | ((exp + 112u) << 23) | (man << 13);
    if (man == 0)
        return sign;
    /* subnormal man * 2^-24: shift the leading one up to bit 10 */
    exp = 113u;
    do {
        man <<= 1;
        exp--;
    } while (!(man & 0x400u));
    return sign | (exp << 23) | ((man & 0x3FFu) << 13);
}

static inline uint16_t lorahook_f32_bits_to_f16(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)             /* NaN: quiet, top payload bits */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u)            /* >= 65520 (halfway past 65504), inf */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) {          /* >= 2^-14: a normal float16 */
        uint32_t r = ax - 0x38000000u;  /* rebias 127 -> 15 */
        r += 0x0FFFu + ((r >> 13) & 1u);  /* ties to even; a carry bumps the exponent */
        return (uint16_t)(sign | (r >> 13));
    }
    if (ax <= 0x33000000u)            /* <= 2^-25, half the smallest subnormal */
        return (uint16_t)sign;
    {
        /* subnormal result: round (1.m * 2^(e-127)) / 2^-24 */
        uint32_t man = (ax & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - (ax >> 23);   /* 14 .. 24 */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++;                      /* may become 0x400, the smallest normal */
        return (uint16_t)(sign | q);
    }
}

/* The one bfloat16 rounding, on a float32's bits: ties to even on the raw
   bits (a carry moves into the exponent, and the largest finite values carry
   into inf; no wrap unless x is a NaN); a NaN keeps its top payload bits and
   is made quiet.  Written once for a uint32_t or a GCC vector of them. */
#define LORAHOOK_BF16_ROUNDED(x) (((x) + 0x7FFFu + (((x) >> 16) & 1u)) >> 16)
#define LORAHOOK_BF16_QUIET(x) (((x) >> 16) | 0x0040u)
#define LORAHOOK_BF16_IS_NAN(x) (((x) & 0x7FFFFFFFu) > 0x7F800000u)

static inline uint16_t lorahook_f32_bits_to_bf16(uint32_t x) {
    /* a select rather than a branch, so that compilers vectorise the loop */
    return (uint16_t)(LORAHOOK_BF16_IS_NAN(x) ? LORAHOOK_BF16_QUIET(x) : LORAHOOK_BF16_ROUNDED(x));
}

LORAHOOK_HALF_FN void lorahook_half_widen_portable(const uint16_t *src, float *dst, size_t n, int kind) {
    size_t i;
    if (kind == LORAHOOK_HALF_BF16) {
        for (i = 0; i < n; i++)
            dst[i] = lorahook_f32_from_bits((uint32_t)src[i] << 16);
    } else {
        for (i = 0; i < n; i++)
            dst[i] = lorahook_f32_from_bits(lorahook_f16_to_f32_bits(src[i]));
    }
}

LORAHOOK_HALF_FN void lorahook_half_narrow_portable(const float *src, uint16_t *dst, size_t n, int kind) {
    size_t i;
    if (kind == LORAHOOK_HALF_BF16) {
        for (i = 0; i < n; i++)
            dst[i] = lorahook_f32_bits_to_bf16(lorahook_f32_bits(src[i]));
    } else {
        for (i = 0; i < n; i++)
            dst[i] = lorahook_f32_bits_to_f16(lorahook_f32_bits(src[i]));
    }
}

/* ------------------------------------------------------------------ */
/* x86-64 vector code.  Full vectors only; the tail (fewer values than  */
/* one vector) goes through the portable code, which gives the same    */
/* bits.  Unaligned loads and stores throughout.                      */
/*                                                                    */
/* Each ends with an explicit VZEROUPPER: GCC does not always insert  */
/* one in target("avx...") functions of a non-AVX build, and a thread */
/* left with dirty upper register halves runs all later SSE code      */
/* (ours, numpy's, the interpreter's) several times slower.           */

#if LORAHOOK_HALF_X86

__attribute__((target("avx2,f16c")))
LORAHOOK_HALF_FN void lorahook_half_widen_avx2(const uint16_t *src, float *dst, size_t n, int kind) {
    size_t i = 0;
    if (kind == LORAHOOK_HALF_BF16) {
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(w, 16));
        }
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
    _mm256_zeroupper();
    lorahook_half_widen_portable(src + i, dst + i, n - i, kind);
}

__attribute__((target("avx2,f16c")))
LORAHOOK_HALF_FN void lorahook_half_narrow_avx2(const float *src, uint16_t *dst, size_t n, int kind) {
    size_t i = 0;
    if (kind == LORAHOOK_HALF_BF16) {
        /* the portable rule on 8 lanes: integer ties-to-even, NaN lanes replaced */
        const __m256i one = _mm256_set1_epi32(1);
        const __m256i bias = _mm256_set1_epi32(0x7FFF);
        const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
        const __m256i inf = _mm256_set1_epi32(0x7F800000);
        const __m256i quiet = _mm256_set1_epi32(0x0040);
        for (; i + 8 <= n; i += 8) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(bias, lsb)), 16);
            /* |x| > inf as signed 32-bit integers: both sides are non-negative */
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absmask), inf);
            __m256i qn = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
            r = _mm256_blendv_epi8(r, qn, nan);
            /* every lane is <= 0xFFFF, so the unsigned saturating pack is exact;
               it interleaves the 128-bit halves, the permute puts them back */
            __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(p));
        }
    } else {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    _mm256_zeroupper();
    lorahook_half_narrow_portable(src + i, dst + i, n - i, kind);
}

/* 16 float32 values rounded to bfloat16 by the one rule above.
   VCVTNEPS2BF16 rounds to nearest even and quiets NaNs exactly as that rule
   does, but treats float32 subnormal inputs as zero: lanes with a zero
   exponent and a non-zero mantissa are redone with the integer rule (exact
   there: no carry can reach a NaN).  The pairs kernel's AVX512_BF16 build
   stores through it too. */
__attribute__((target("avx512f,avx512bf16,avx512vl"), always_inline))
static inline __m256i lorahook_bf16_round16(__m512 f) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(f);
    __m512i x = _mm512_castps_si512(f);
    __mmask16 sub = _mm512_mask_test_epi32_mask(
        _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x7F800000)), x,
        _mm512_set1_epi32(0x007FFFFF));
    if (sub) {
        __m512i ir = _mm512_srli_epi32(
            _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)))), 16);
        /* merge at 32-bit granularity: AVX-512F alone, no BW */
        r = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_cvtepu16_epi32(r), sub, ir));
    }
    return r;
}

__attribute__((target("avx512f,avx512bf16,avx512vl")))
LORAHOOK_HALF_FN void lorahook_half_widen_avx512(const uint16_t *src, float *dst, size_t n, int kind) {
    size_t i = 0;
    if (kind == LORAHOOK_HALF_BF16) {
        for (; i + 16 <= n; i += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
            _mm512_storeu_si512((void *)(dst + i), _mm512_slli_epi32(w, 16));
        }
    } else {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    }
    _mm256_zeroupper();
    lorahook_half_widen_portable(src + i, dst + i, n - i, kind);
}

__attribute__((target("avx512f,avx512bf16,avx512vl")))
LORAHOOK_HALF_FN void lorahook_half_narrow_avx512(const float *src, uint16_t *dst, size_t n, int kind) {
    size_t i = 0;
    if (kind == LORAHOOK_HALF_BF16) {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + i), lorahook_bf16_round16(_mm512_loadu_ps(src + i)));
    } else {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    _mm256_zeroupper();
    lorahook_half_narrow_portable(src + i, dst + i, n - i, kind);
}

#endif /* LORAHOOK_HALF_X86 */

/* ------------------------------------------------------------------ */
/* Dispatch on the target.                                             */

/* Widen n 16-bit values of `kind` to float32 (rules above) with target `isa`'s code,
   a target this CPU supports. */
static inline void lorahook_half_widen_on(int isa, const uint16_t *src, float *dst, size_t n,
                                          int kind) {
#if LORAHOOK_HALF_X86
    switch (isa) {
    case LH_ISA_AVX512BF16:
        lorahook_half_widen_avx512(src, dst, n, kind);
        return;
    case LH_ISA_AVX512:
    case LH_ISA_AVX2:
        lorahook_half_widen_avx2(src, dst, n, kind);
        return;
    default:
        break;
    }
#else
    (void)isa;
#endif
    lorahook_half_widen_portable(src, dst, n, kind);
}

/* Narrow n float32 values to 16-bit values of `kind` (rules above) with `isa`'s code. */
static inline void lorahook_half_narrow_on(int isa, const float *src, uint16_t *dst, size_t n,
                                           int kind) {
#if LORAHOOK_HALF_X86
    switch (isa) {
    case LH_ISA_AVX512BF16:
        lorahook_half_narrow_avx512(src, dst, n, kind);
        return;
    case LH_ISA_AVX512:
    case LH_ISA_AVX2:
        lorahook_half_narrow_avx2(src, dst, n, kind);
        return;
    default:
        break;
    }
#else
    (void)isa;
#endif
    lorahook_half_narrow_portable(src, dst, n, kind);
}

/* Widen / narrow on the active target. */
LORAHOOK_HALF_FN void lorahook_half_widen(const uint16_t *src, float *dst, size_t n, int kind) {
    lorahook_half_widen_on(lh_isa_active(), src, dst, n, kind);
}

LORAHOOK_HALF_FN void lorahook_half_narrow(const float *src, uint16_t *dst, size_t n, int kind) {
    lorahook_half_narrow_on(lh_isa_active(), src, dst, n, kind);
}

#endif /* LORAHOOK_HALF_H */
