/* One build of the pairs kernel: pairs.h includes this file once per
 * instruction set, with LH_P_SUFFIX (the functions' suffix), LH_P_W (float32
 * values a stripe) and LH_P_ISA (an LH_ISA_* target of isa.h: 0 portable, 1 AVX2 + FMA +
 * F16C, 2 AVX-512, 3 AVX-512 with AVX512_BF16, whose bfloat16 first products are the CPU's
 * bfloat16 dot products) defined, inside a `#pragma GCC target` region for the vector builds.
 *
 * Vectors are GCC vector extensions of LH_P_W floats, which each build lowers
 * to its own registers; only the float16 conversions name an instruction.
 * Vectors are never passed by value between functions that are not inlined.
 */
#define LH_P_CAT2(a, b) a##_##b
#define LH_P_CAT(a, b) LH_P_CAT2(a, b)
#define LH_P_NAME(n) LH_P_CAT(n, LH_P_SUFFIX)

#define VF LH_P_NAME(lh_vf)
#define VU LH_P_NAME(lh_vu)
#define VH LH_P_NAME(lh_vh)
#define LH_P_INLINE static inline __attribute__((always_inline))

typedef float VF __attribute__((vector_size(LH_P_W * 4)));
typedef uint32_t VU __attribute__((vector_size(LH_P_W * 4)));
typedef uint16_t VH __attribute__((vector_size(LH_P_W * 2)));
typedef int8_t LH_P_NAME(lh_vb) __attribute__((vector_size(LH_P_W)));
typedef int32_t LH_P_NAME(lh_vi) __attribute__((vector_size(LH_P_W * 4)));

/* LH_P_W values of `kind` at p, as float32 */
LH_P_INLINE void LH_P_NAME(lh_load)(const char *p, const int kind, VF *out) {
    if (kind == LH_P_F32) {
        memcpy(out, p, sizeof(VF));
    } else if (kind == LH_P_I8) {
#if LH_P_ISA >= 2
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        memcpy(out, &f, sizeof f);
#elif LH_P_ISA == 1
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        memcpy(out, &f, sizeof f);
#else
        LH_P_NAME(lh_vb) q;
        memcpy(&q, p, sizeof q);
        *out = __builtin_convertvector(__builtin_convertvector(q, LH_P_NAME(lh_vi)), VF);
#endif
    } else if (kind == LH_P_BF16) {
        VH h;
        VU u;
        memcpy(&h, p, sizeof h);
        u = __builtin_convertvector(h, VU) << 16;
        memcpy(out, &u, sizeof u);
    } else {
#if LH_P_ISA >= 2
        __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        memcpy(out, &f, sizeof f);
#elif LH_P_ISA == 1
        __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        memcpy(out, &f, sizeof f);
#else
        uint16_t h[LH_P_W];
        uint32_t u[LH_P_W];
        int l;
        memcpy(h, p, sizeof h);
        for (l = 0; l < LH_P_W; l++)
            u[l] = lorahook_f16_to_f32_bits(h[l]);
        memcpy(out, u, sizeof u);
#endif
    }
}

/* v stored at p as LH_P_W values of `kind`, each rounded once to nearest even */
LH_P_INLINE void LH_P_NAME(lh_store)(char *p, const int kind, const VF *v) {
    if (kind == LH_P_F32) {
        memcpy(p, v, sizeof(VF));
    } else if (kind == LH_P_BF16) {
#if LH_P_ISA == 3
        __m512 f;
        memcpy(&f, v, sizeof f);
        _mm256_storeu_si256((__m256i *)p, lorahook_bf16_round16(f));
#else
        /* halfconv.h's rounding, lane by lane */
        VU u, nan;
        VH h;
        memcpy(&u, v, sizeof u);
        nan = (VU)LORAHOOK_BF16_IS_NAN(u);
        h = __builtin_convertvector((nan & LORAHOOK_BF16_QUIET(u)) |
                                    (~nan & LORAHOOK_BF16_ROUNDED(u)), VH);
        memcpy(p, &h, sizeof h);
#endif
    } else {
#if LH_P_ISA >= 2
        __m512 f;
        memcpy(&f, v, sizeof f);
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
#elif LH_P_ISA == 1
        __m256 f;
        memcpy(&f, v, sizeof f);
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
#else
        uint32_t u[LH_P_W];
        uint16_t h[LH_P_W];
        int l;
        memcpy(u, v, sizeof u);
        for (l = 0; l < LH_P_W; l++)
            h[l] = lorahook_f32_bits_to_f16(u[l]);
        memcpy(p, h, sizeof h);
#endif
    }
}

/* one value of `kind` at element i of p */
LH_P_INLINE float LH_P_NAME(lh_load1)(const char *p, ptrdiff_t i, const int kind) {
    if (kind == LH_P_F32)
        return ((const float *)p)[i];
    if (kind == LH_P_I8)
        return (float)((const int8_t *)p)[i];
    if (kind == LH_P_BF16)
        return lorahook_f32_from_bits((uint32_t)((const uint16_t *)p)[i] << 16);
    return lorahook_f32_from_bits(lorahook_f16_to_f32_bits(((const uint16_t *)p)[i]));
}

LH_P_INLINE void LH_P_NAME(lh_store1)(char *p, ptrdiff_t i, const int kind, float f) {
    if (kind == LH_P_F32)
        ((float *)p)[i] = f;
    else if (kind == LH_P_BF16)
        ((uint16_t *)p)[i] = lorahook_f32_bits_to_bf16(lorahook_f32_bits(f));
    else
        ((uint16_t *)p)[i] = lorahook_f32_bits_to_f16(lorahook_f32_bits(f));
}

/* The sum of v's lanes, in a fixed tree (halves added until one lane is left). */
LH_P_INLINE float LH_P_NAME(lh_lanes)(const VF *v) {
    float h[LH_P_W];
    int w, l;
    memcpy(h, v, sizeof h);
    for (w = LH_P_W / 2; w >= 1; w /= 2)
        for (l = 0; l < w; l++)
            h[l] += h[l + w];
    return h[0];
}

/* First phase, NB rows (positions p .. p + NB) of slot s, two rows of A at a time:
   t[j][position] = scale * A[s][j] . x[row] for j below the slot's rank (W8: A in int8,
   times its row's scale). */
LH_P_INLINE void LH_P_NAME(lh_shrink_rows)(const lh_pairs *c, const lh_slice *sl, ptrdiff_t s,
                                           ptrdiff_t p, const int NB, const int kind,
                                           const int W8) {
    const ptrdiff_t es = kind == LH_P_F32 ? 4 : 2;
    const int wk = W8 ? LH_P_I8 : kind;         /* the weights' kind and size */
    const ptrdiff_t ew = W8 ? 1 : es;
    const ptrdiff_t d_in = c->d_in;
    const char *xr[LH_P_RB1];
    const char *as = sl->A[s];
    const ptrdiff_t ld = c->n_covered;  /* t is (rmax, n_covered) per slice: t[j][position] */
    float *t = c->T + sl->t_off + p;
    int b, j, rank = sl->ranks[s];
    for (b = 0; b < NB; b++)
        xr[b] = c->X + (ptrdiff_t)c->order[p + b] * c->ldx * es;
    for (j = 0; j < rank; j += 2) {
        const int two = j + 1 < rank;   /* else the second row repeats the first, unstored */
        const char *a0p = as + (ptrdiff_t)j * d_in * ew;
        const char *a1p = two ? a0p + d_in * ew : a0p;
        /* the next pair of rows, one line ahead per stripe: a slot's A is read once per
           call and is seldom in cache (the base weights streamed through since) */
        const char *next = j + 2 < rank ? a0p + 2 * d_in * ew : NULL;
        const ptrdiff_t next_len = (j + 3 < rank ? 2 : 1) * d_in * ew;
        VF acc0[LH_P_RB1], acc1[LH_P_RB1], a0, a1, xv;
        float tail0[LH_P_RB1], tail1[LH_P_RB1];
        ptrdiff_t i = 0;
        for (b = 0; b < NB; b++) {
            acc0[b] = (VF){0};
            acc1[b] = (VF){0};
            tail0[b] = tail1[b] = 0.0f;
        }
#if LH_P_ISA == 3
        /* bfloat16 pairs multiplied and summed into float32 by the CPU (VDPBF16PS):
           32 values a step, no widening */
        if (kind == LH_P_BF16 && !W8) {
            for (; i + 32 <= d_in; i += 32) {
                if (next != NULL) {
                    __builtin_prefetch(next + 2 * i, 0, 3);
                    if (2 * i + d_in * es < next_len)
                        __builtin_prefetch(next + d_in * es + 2 * i, 0, 3);
                }
                __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(a0p + i * 2));
                __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(a1p + i * 2));
                for (b = 0; b < NB; b++) {
                    __m512bh xb = (__m512bh)_mm512_loadu_si512((const void *)(xr[b] + i * 2));
                    acc0[b] = (VF)_mm512_dpbf16_ps((__m512)acc0[b], xb, b0);
                    acc1[b] = (VF)_mm512_dpbf16_ps((__m512)acc1[b], xb, b1);
                }
            }
        }
#endif
        for (; i + LH_P_W <= d_in; i += LH_P_W) {
            if (next != NULL && (i * ew) % 64 < LH_P_W * ew) {  /* once per cache line */
                __builtin_prefetch(next + i * ew, 0, 3);
                if (i * ew + d_in * ew < next_len)
                    __builtin_prefetch(next + d_in * ew + i * ew, 0, 3);
            }
            LH_P_NAME(lh_load)(a0p + i * ew, wk, &a0);
            LH_P_NAME(lh_load)(a1p + i * ew, wk, &a1);
            for (b = 0; b < NB; b++) {
                LH_P_NAME(lh_load)(xr[b] + i * es, kind, &xv);
                acc0[b] += xv * a0;
                acc1[b] += xv * a1;
            }
        }
        for (; i < d_in; i++) {
            float f0 = LH_P_NAME(lh_load1)(a0p, i, wk), f1 = LH_P_NAME(lh_load1)(a1p, i, wk);
            for (b = 0; b < NB; b++) {
                float xf = LH_P_NAME(lh_load1)(xr[b], i, kind);
                tail0[b] += xf * f0;
                tail1[b] += xf * f1;
            }
        }
        float s0 = c->scale, s1 = c->scale;
        if (W8) {
            s0 *= sl->SA[s][j];
            if (two)
                s1 *= sl->SA[s][j + 1];
        }
        for (b = 0; b < NB; b++) {
            t[(ptrdiff_t)j * ld + b] = s0 * (LH_P_NAME(lh_lanes)(&acc0[b]) + tail0[b]);
            if (two)
                t[(ptrdiff_t)(j + 1) * ld + b] = s1 * (LH_P_NAME(lh_lanes)(&acc1[b]) + tail1[b]);
        }
    }
}

/* Second phase, NB rows (positions p .. p + NB) of slot s, columns [c0, c1) of the
   slice: y[row, col + c] (+)= sum_j t[j][position] Bt[s][j][c] (W8: Bt in int8, the sum
   times its column's scale). */
LH_P_INLINE void LH_P_NAME(lh_expand_rows)(const lh_pairs *c, const lh_slice *sl, ptrdiff_t s,
                                           ptrdiff_t p, const int NB, ptrdiff_t c0, ptrdiff_t c1,
                                           const int kind, const int W8) {
    const ptrdiff_t es = kind == LH_P_F32 ? 4 : 2;
    const int wk = W8 ? LH_P_I8 : kind;
    const ptrdiff_t ew = W8 ? 1 : es;
    const float *sb = W8 ? sl->SB[s] : NULL;
    const ptrdiff_t d_out = sl->d_out;
    const char *bs = sl->Bt[s];
    const ptrdiff_t ld = c->n_covered;
    const float *t = c->T + sl->t_off + p;  /* t[j * ld + b]: row b's j-th first product */
    char *yr[LH_P_RB2];
    int b, j, rank = sl->ranks[s];
    ptrdiff_t col = c0;
    for (b = 0; b < NB; b++) {
        yr[b] = c->Y + ((ptrdiff_t)c->order[p + b] * c->ldy + sl->col) * es;
    }
    /* int8 weights for one or two rows: four stripes of columns a step, so that several
       sums over the rank are in flight beside the conversions (each column is summed in the
       same order as below: the same bits; float32 weights measured slower this way) */
    for (; W8 && NB <= 2 && col + 4 * LH_P_W <= c1; col += 4 * LH_P_W) {
        VF acc4[2][4], bv4[4], yv;
        int v;
        for (b = 0; b < NB; b++)
            for (v = 0; v < 4; v++)
                acc4[b][v] = (VF){0};
        for (j = 0; j < rank; j++) {
            for (v = 0; v < 4; v++)
                LH_P_NAME(lh_load)(bs + ((ptrdiff_t)j * d_out + col + v * LH_P_W) * ew, wk,
                                   &bv4[v]);
            for (b = 0; b < NB; b++) {
                const float tj = t[(ptrdiff_t)j * ld + b];
                for (v = 0; v < 4; v++)
                    acc4[b][v] += tj * bv4[v];
            }
        }
        if (W8 && rank > 0) {
            for (v = 0; v < 4; v++)
                LH_P_NAME(lh_load)((const char *)(sb + col + v * LH_P_W), LH_P_F32, &bv4[v]);
            for (b = 0; b < NB; b++)
                for (v = 0; v < 4; v++)
                    acc4[b][v] *= bv4[v];
        }
        for (b = 0; b < NB; b++) {
            for (v = 0; v < 4; v++) {
                if (c->add) {
                    LH_P_NAME(lh_load)(yr[b] + (col + v * LH_P_W) * es, kind, &yv);
                    acc4[b][v] = yv + acc4[b][v];
                }
                LH_P_NAME(lh_store)(yr[b] + (col + v * LH_P_W) * es, kind, &acc4[b][v]);
            }
        }
    }
    for (; col + LH_P_W <= c1; col += LH_P_W) {
        VF acc[LH_P_RB2], bv, yv;
        for (b = 0; b < NB; b++)
            acc[b] = (VF){0};
        for (j = 0; j < rank; j++) {
            LH_P_NAME(lh_load)(bs + ((ptrdiff_t)j * d_out + col) * ew, wk, &bv);
            for (b = 0; b < NB; b++)
                acc[b] += t[(ptrdiff_t)j * ld + b] * bv;
        }
        if (W8 && rank > 0) {  /* (a slot of rank 0 has no scales: its rows get zeros) */
            LH_P_NAME(lh_load)((const char *)(sb + col), LH_P_F32, &bv);
            for (b = 0; b < NB; b++)
                acc[b] *= bv;
        }
        for (b = 0; b < NB; b++) {
            if (c->add) {
                LH_P_NAME(lh_load)(yr[b] + col * es, kind, &yv);
                acc[b] = yv + acc[b];
            }
            LH_P_NAME(lh_store)(yr[b] + col * es, kind, &acc[b]);
        }
    }
    for (; col < c1; col++) {
        for (b = 0; b < NB; b++) {
            float acc = 0.0f;
            for (j = 0; j < rank; j++)
                acc += t[(ptrdiff_t)j * ld + b] *
                       LH_P_NAME(lh_load1)(bs, (ptrdiff_t)j * d_out + col, wk);
            if (W8 && rank > 0)
                acc *= sb[col];
            if (c->add)
                acc = LH_P_NAME(lh_load1)(yr[b], col, kind) + acc;
            LH_P_NAME(lh_store1)(yr[b], col, kind, acc);
        }
    }
}

/* Rows [lo, hi) of slot s through a phase, in blocks of 8 (second phase), 4, 2 and 1:
   each block size is a constant, so its accumulators stay in registers. */
LH_P_INLINE void LH_P_NAME(lh_shrink_span)(const lh_pairs *c, const lh_slice *sl, ptrdiff_t s,
                                           ptrdiff_t lo, ptrdiff_t hi, const int kind,
                                           const int W8) {
    ptrdiff_t p = lo;
    for (; p + 4 <= hi; p += 4)
        LH_P_NAME(lh_shrink_rows)(c, sl, s, p, 4, kind, W8);
    if (p + 2 <= hi) {
        LH_P_NAME(lh_shrink_rows)(c, sl, s, p, 2, kind, W8);
        p += 2;
    }
    if (p < hi)
        LH_P_NAME(lh_shrink_rows)(c, sl, s, p, 1, kind, W8);
}

LH_P_INLINE void LH_P_NAME(lh_expand_span)(const lh_pairs *c, const lh_slice *sl, ptrdiff_t s,
                                           ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t c0,
                                           ptrdiff_t c1, const int kind, const int W8) {
    ptrdiff_t p = lo;
    for (; p + 8 <= hi; p += 8)
        LH_P_NAME(lh_expand_rows)(c, sl, s, p, 8, c0, c1, kind, W8);
    if (p + 4 <= hi) {
        LH_P_NAME(lh_expand_rows)(c, sl, s, p, 4, c0, c1, kind, W8);
        p += 4;
    }
    if (p + 2 <= hi) {
        LH_P_NAME(lh_expand_rows)(c, sl, s, p, 2, c0, c1, kind, W8);
        p += 2;
    }
    if (p < hi)
        LH_P_NAME(lh_expand_rows)(c, sl, s, p, 1, c0, c1, kind, W8);
}

/* The share `part` of `parts` of a call, for one element kind (and int8 weights or not). */
LH_P_INLINE void LH_P_NAME(lh_pairs_part_k)(const lh_pairs *c, int part, int parts,
                                            void (*barrier)(void), const int kind, const int W8) {
    ptrdiff_t n = c->n_covered, s, p0, p1, blocks = 0, g0, g1, first = 0;
    int i;
    /* first phase: this part's covered rows, slot by slot */
    p0 = n * part / parts;
    p1 = n * (part + 1) / parts;
    for (i = 0; i < c->n_slices; i++) {
        const lh_slice *sl = &c->slices[i];
        for (s = 0; s < c->n_slots; s++) {
            ptrdiff_t lo = c->starts[s] > p0 ? c->starts[s] : p0;
            ptrdiff_t hi = c->starts[s + 1] < p1 ? c->starts[s + 1] : p1;
            if (sl->ranks[s] == 0)
                continue;
            if (lo < hi)
                LH_P_NAME(lh_shrink_span)(c, sl, s, lo, hi, kind, W8);
        }
    }
    if (parts > 1)
        barrier();  /* every t is written before any output is */
    /* second phase: this part's blocks of columns, over the slices one after another */
    for (i = 0; i < c->n_slices; i++)
        blocks += c->slices[i].blocks;
    g0 = blocks * part / parts;
    g1 = blocks * (part + 1) / parts;
    for (i = 0; i < c->n_slices; first += c->slices[i].blocks, i++) {
        const lh_slice *sl = &c->slices[i];
        ptrdiff_t b0 = g0 - first, b1 = g1 - first, c0, c1;
        if (b0 < 0) b0 = 0;
        if (b1 > sl->blocks) b1 = sl->blocks;
        if (b0 >= b1)
            continue;
        c0 = b0 * LH_P_COLS;
        c1 = b1 * LH_P_COLS < sl->d_out ? b1 * LH_P_COLS : sl->d_out;
        for (s = 0; s < c->n_slots; s++) {
            ptrdiff_t lo = c->starts[s], hi = c->starts[s + 1];
            if (sl->ranks[s] == 0 && c->add)
                continue;  /* nothing to add; with add == 0 the rows get zeros */
            if (lo < hi)
                LH_P_NAME(lh_expand_span)(c, sl, s, lo, hi, c0, c1, kind, W8);
        }
    }
}

static void LH_P_NAME(lh_pairs_part)(const lh_pairs *c, int part, int parts,
                                     void (*barrier)(void)) {
    if (c->w8) {
        if (c->kind == LH_P_BF16)
            LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_BF16, 1);
        else if (c->kind == LH_P_F16)
            LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_F16, 1);
        else
            LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_F32, 1);
    } else if (c->kind == LH_P_BF16)
        LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_BF16, 0);
    else if (c->kind == LH_P_F16)
        LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_F16, 0);
    else
        LH_P_NAME(lh_pairs_part_k)(c, part, parts, barrier, LH_P_F32, 0);
}

#undef VF
#undef VU
#undef VH
#undef LH_P_INLINE
#undef LH_P_NAME
#undef LH_P_CAT
#undef LH_P_CAT2
