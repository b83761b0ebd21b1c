/* Adapter factors held in int8: the two products of a LoRA delta (shrink: A x, expand: B t), widened in registers.
 *
 * A layer held in int8 keeps A as int8 (rank, d_in) with one float32 scale per
 * row (sa), and B^T as int8 (rank, d_out) with one float32 scale per output
 * (sb): A[q, k] = sa[q] * a8[q, k], B[o, q] = sb[o] * bt8[q, o].  For up to
 * LH_I8_ROWS rows at a time:
 *
 *   void lorahook_i8_shrink(const int8_t *a8, const float *sa, int rank, int d_in,
 *                         const float *const *x, int nx, const float *alpha, float *t);
 *       t[j * rank + q] = alpha[j] * sa[q] * sum_k a8[q, k] * x[j][k]
 *   void lorahook_i8_expand(const int8_t *bt8, const float *sb, int rank, int d_out,
 *                       const float *t, int nx, float *const *y);
 *       y[j][o] += sb[o] * sum_q bt8[q, o] * t[j * rank + q]
 *
 * Each int8 value is converted to float32 in a register as it is used (no
 * widened copy of a factor is ever written), the sums are accumulated in
 * float32, and each output value is updated by one fused multiply-add, so it
 * is rounded once.  Each call reads the factors once for its nx rows (the
 * order of the sums depends on nx, so a row's last bits may too).
 *
 * The target (isa.h) picks AVX2 + FMA code, 8 values a step ("avx2" and above), or plain C.
 * Everything is static, allocates nothing and touches no Python object:
 * callable without the GIL.  x, y and t must not overlap.
 */
#ifndef LORAHOOK_INT8_H
#define LORAHOOK_INT8_H

#include <stddef.h>
#include <stdint.h>

#include "isa.h"

#define LORAHOOK_I8_X86 LH_ISA_X86

#if defined(__GNUC__) || defined(__clang__)
#define LORAHOOK_I8_FN static __attribute__((unused))
#else
#define LORAHOOK_I8_FN static
#endif

/* Rows a call takes at most: their factors' values are converted once for all of them. */
#define LH_I8_ROWS 4
/* Outputs summed at once by the plain-C expand product (a block of accumulators). */
#define LH_I8_BLOCK 64

/* ------------------------------------------------------------------ */
/* plain C                                                             */

LORAHOOK_I8_FN void lorahook_i8_shrink_c(const int8_t *a8, const float *sa, int rank, int d_in,
                                       const float *const *x, int nx, const float *alpha,
                                       float *t) {
    int q, j, k;
    for (q = 0; q < rank; q++) {
        const int8_t *ar = a8 + (size_t)q * d_in;
        for (j = 0; j < nx; j++) {
            const float *xj = x[j];
            float acc = 0.0f;
            for (k = 0; k < d_in; k++)
                acc += (float)ar[k] * xj[k];
            t[j * rank + q] = alpha[j] * sa[q] * acc;
        }
    }
}

LORAHOOK_I8_FN void lorahook_i8_expand_c(const int8_t *bt8, const float *sb, int rank, int d_out,
                                     const float *t, int nx, float *const *y) {
    float acc[LH_I8_BLOCK];
    int o0, o, q, j, nb;
    for (j = 0; j < nx; j++) {
        for (o0 = 0; o0 < d_out; o0 += LH_I8_BLOCK) {
            nb = d_out - o0 < LH_I8_BLOCK ? d_out - o0 : LH_I8_BLOCK;
            for (o = 0; o < nb; o++)
                acc[o] = 0.0f;
            for (q = 0; q < rank; q++) {
                const int8_t *br = bt8 + (size_t)q * d_out + o0;
                float tq = t[j * rank + q];
                for (o = 0; o < nb; o++)
                    acc[o] += tq * (float)br[o];
            }
            for (o = 0; o < nb; o++)
                y[j][o0 + o] = __builtin_fmaf(sb[o0 + o], acc[o], y[j][o0 + o]);
        }
    }
}

/* ------------------------------------------------------------------ */
/* AVX2 + FMA.  Ends with VZEROUPPER (see halfconv.h).                */

#if LORAHOOK_I8_X86

#define LH_I8_TARGET __attribute__((target("avx2,fma")))

/* 8 int8 values at p as 8 float32 lanes */
#define LH_I8_LOAD8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

LH_I8_TARGET static inline float lorahook_i8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The shrink product for NX rows and QB rows of A at once, U vectors of each
   row a step: QB * NX * U independent sums keep the FMA units busy.  NX, QB
   and U are constants in each caller, so the loops over them unroll. */
LH_I8_TARGET static inline __attribute__((always_inline))
void lorahook_i8_shrink_block(const int8_t *a8, const float *sa, int q0, int d_in,
                            const float *const *x, const int NX, const int QB, const int U,
                            const float *alpha, int rank, float *t) {
    __m256 acc[4][LH_I8_ROWS][2];
    int b, j, u, k;
    for (b = 0; b < QB; b++)
        for (j = 0; j < NX; j++)
            for (u = 0; u < U; u++)
                acc[b][j][u] = _mm256_setzero_ps();
    for (k = 0; k + 8 * U <= d_in; k += 8 * U) {
        for (u = 0; u < U; u++) {
            __m256 xv[LH_I8_ROWS];
            for (j = 0; j < NX; j++)
                xv[j] = _mm256_loadu_ps(x[j] + k + 8 * u);
            for (b = 0; b < QB; b++) {
                __m256 w = LH_I8_LOAD8(a8 + (size_t)(q0 + b) * d_in + k + 8 * u);
                for (j = 0; j < NX; j++)
                    acc[b][j][u] = _mm256_fmadd_ps(w, xv[j], acc[b][j][u]);
            }
        }
    }
    for (; k + 8 <= d_in; k += 8) {  /* fewer than U vectors left */
        for (b = 0; b < QB; b++) {
            __m256 w = LH_I8_LOAD8(a8 + (size_t)(q0 + b) * d_in + k);
            for (j = 0; j < NX; j++)
                acc[b][j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k), acc[b][j][0]);
        }
    }
    for (b = 0; b < QB; b++) {
        const int8_t *ar = a8 + (size_t)(q0 + b) * d_in;
        for (j = 0; j < NX; j++) {
            __m256 v = acc[b][j][0];
            float sum;
            int kk;
            for (u = 1; u < U; u++)
                v = _mm256_add_ps(v, acc[b][j][u]);
            sum = lorahook_i8_hsum(v);
            for (kk = k; kk < d_in; kk++)
                sum += (float)ar[kk] * x[j][kk];
            t[j * rank + q0 + b] = alpha[j] * sa[q0 + b] * sum;
        }
    }
}

/* every row of A for NX rows: QB rows of A a step, then one at a time */
LH_I8_TARGET static inline __attribute__((always_inline))
void lorahook_i8_shrink_nx(const int8_t *a8, const float *sa, int rank, int d_in,
                         const float *const *x, const int NX, const float *alpha, float *t) {
    const int QB = NX <= 2 ? 4 : 2, U = NX == 1 ? 2 : 1;
    int q = 0;
    for (; q + QB <= rank; q += QB)
        lorahook_i8_shrink_block(a8, sa, q, d_in, x, NX, QB, U, alpha, rank, t);
    for (; q < rank; q++)
        lorahook_i8_shrink_block(a8, sa, q, d_in, x, NX, 1, 2, alpha, rank, t);
}

LH_I8_TARGET LORAHOOK_I8_FN void lorahook_i8_shrink_avx2(const int8_t *a8, const float *sa, int rank,
                                                       int d_in, const float *const *x, int nx,
                                                       const float *alpha, float *t) {
    switch (nx) {
    case 1: lorahook_i8_shrink_nx(a8, sa, rank, d_in, x, 1, alpha, t); break;
    case 2: lorahook_i8_shrink_nx(a8, sa, rank, d_in, x, 2, alpha, t); break;
    case 3: lorahook_i8_shrink_nx(a8, sa, rank, d_in, x, 3, alpha, t); break;
    default: lorahook_i8_shrink_nx(a8, sa, rank, d_in, x, 4, alpha, t); break;
    }
    _mm256_zeroupper();
}

/* The expand product for NX rows on OB vectors of outputs (8 * OB outputs from o):
   OB * NX independent sums over the rank. */
LH_I8_TARGET static inline __attribute__((always_inline))
void lorahook_i8_expand_block(const int8_t *bt8, const float *sb, int rank, int d_out, int o,
                          const float *t, const int NX, const int OB, float *const *y) {
    __m256 acc[8][LH_I8_ROWS];
    int v, q, j;
    for (v = 0; v < OB; v++)
        for (j = 0; j < NX; j++)
            acc[v][j] = _mm256_setzero_ps();
    for (q = 0; q < rank; q++) {
        const int8_t *br = bt8 + (size_t)q * d_out + o;
        __m256 tq[LH_I8_ROWS];
        for (j = 0; j < NX; j++)
            tq[j] = _mm256_broadcast_ss(t + j * rank + q);
        for (v = 0; v < OB; v++) {
            __m256 w = LH_I8_LOAD8(br + 8 * v);
            for (j = 0; j < NX; j++)
                acc[v][j] = _mm256_fmadd_ps(w, tq[j], acc[v][j]);
        }
    }
    for (v = 0; v < OB; v++) {
        __m256 s = _mm256_loadu_ps(sb + o + 8 * v);
        for (j = 0; j < NX; j++) {
            float *yp = y[j] + o + 8 * v;
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(s, acc[v][j], _mm256_loadu_ps(yp)));
        }
    }
}

LH_I8_TARGET static inline __attribute__((always_inline))
void lorahook_i8_expand_nx(const int8_t *bt8, const float *sb, int rank, int d_out, const float *t,
                       const int NX, float *const *y) {
    const int OB = NX == 1 ? 8 : NX == 2 ? 4 : 2;
    int o = 0, q, j;
    for (; o + 8 * OB <= d_out; o += 8 * OB)
        lorahook_i8_expand_block(bt8, sb, rank, d_out, o, t, NX, OB, y);
    for (; o + 8 <= d_out; o += 8)
        lorahook_i8_expand_block(bt8, sb, rank, d_out, o, t, NX, 1, y);
    for (; o < d_out; o++) {  /* the last outputs, one at a time */
        for (j = 0; j < NX; j++) {
            float acc = 0.0f;
            for (q = 0; q < rank; q++)
                acc += t[j * rank + q] * (float)bt8[(size_t)q * d_out + o];
            y[j][o] = __builtin_fmaf(sb[o], acc, y[j][o]);
        }
    }
}

LH_I8_TARGET LORAHOOK_I8_FN void lorahook_i8_expand_avx2(const int8_t *bt8, const float *sb, int rank,
                                                     int d_out, const float *t, int nx,
                                                     float *const *y) {
    switch (nx) {
    case 1: lorahook_i8_expand_nx(bt8, sb, rank, d_out, t, 1, y); break;
    case 2: lorahook_i8_expand_nx(bt8, sb, rank, d_out, t, 2, y); break;
    case 3: lorahook_i8_expand_nx(bt8, sb, rank, d_out, t, 3, y); break;
    default: lorahook_i8_expand_nx(bt8, sb, rank, d_out, t, 4, y); break;
    }
    _mm256_zeroupper();
}

#endif /* LORAHOOK_I8_X86 */

/* ------------------------------------------------------------------ */
/* Dispatch                                                            */

LORAHOOK_I8_FN void lorahook_i8_shrink(const int8_t *a8, const float *sa, int rank,
                                     int d_in, const float *const *x, int nx, const float *alpha,
                                     float *t) {
#if LORAHOOK_I8_X86
    if (lh_isa_active() >= LH_ISA_AVX2) {
        lorahook_i8_shrink_avx2(a8, sa, rank, d_in, x, nx, alpha, t);
        return;
    }
#endif
    lorahook_i8_shrink_c(a8, sa, rank, d_in, x, nx, alpha, t);
}

LORAHOOK_I8_FN void lorahook_i8_expand(const int8_t *bt8, const float *sb, int rank,
                                   int d_out, const float *t, int nx, float *const *y) {
#if LORAHOOK_I8_X86
    if (lh_isa_active() >= LH_ISA_AVX2) {
        lorahook_i8_expand_avx2(bt8, sb, rank, d_out, t, nx, y);
        return;
    }
#endif
    lorahook_i8_expand_c(bt8, sb, rank, d_out, t, nx, y);
}

#endif /* LORAHOOK_INT8_H */
