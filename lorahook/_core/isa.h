/* The instruction sets the compiled core is built for, and the one choice among them.
 *
 * Targets (a name means the same CPU features in every file of the core):
 *
 *   LH_ISA_PORTABLE    "portable"    plain C, the build's baseline: runs on every CPU
 *   LH_ISA_AVX2        "avx2"        AVX2 + FMA + F16C
 *   LH_ISA_AVX512      "avx512"      the above and AVX-512 F, VL, BW and DQ
 *   LH_ISA_AVX512BF16  "avx512bf16"  the above and AVX512_BF16
 *
 * Each kernel (conversions, the pairs kernel, int8 factors, the loaders' checks) is built
 * per target where it has code for it, and runs the best code it has at or below the
 * active target: float16 conversions have no AVX-512 code without AVX512_BF16, so on
 * "avx512" they run their AVX2 code.  Only x86-64 builds with GCC or Clang hold the
 * vector code, each part compiled for its own target (`#pragma GCC target` or
 * `__attribute__((target))`); nothing else uses instructions beyond the baseline, so no
 * target can fault on a CPU without its features.  LORAHOOK_HALF_NO_SIMD builds the
 * portable code alone, as on other architectures.
 *
 * The active target is one value per process, owned by lorahook._core.halfconv (which
 * reads LORAHOOK_ISA at import and offers set_isa): every other compiled module attaches
 * to it once, at import (lh_isa_attach with halfconv's isa_cell), and every kernel reads it
 * with lh_isa_active().  Kernels take no target argument.  A module not attached (none
 * should be) runs the best target this CPU supports.  Reads and writes are relaxed atomics:
 * a call that reads the target once runs on it to the end; conversions give the same bits
 * on every target, kernels built per target the same bits from run to run on one target.
 */
#ifndef LORAHOOK_ISA_H
#define LORAHOOK_ISA_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(LORAHOOK_HALF_NO_SIMD)
#define LH_ISA_X86 1
#include <immintrin.h>
#else
#define LH_ISA_X86 0
#endif

#define LH_ISA_PORTABLE 0
#define LH_ISA_AVX2 1
#define LH_ISA_AVX512 2
#define LH_ISA_AVX512BF16 3
#define LH_ISA_COUNT 4

#if defined(__GNUC__) || defined(__clang__)
#define LH_ISA_FN static __attribute__((unused))
#else
#define LH_ISA_FN static
#endif

/* The target's name ("portable", "avx2", "avx512", "avx512bf16"), or NULL. */
LH_ISA_FN const char *lh_isa_name(int isa) {
    static const char *const names[LH_ISA_COUNT] = {"portable", "avx2", "avx512", "avx512bf16"};
    return isa >= 0 && isa < LH_ISA_COUNT ? names[isa] : (const char *)0;
}

/* The CPU features the target needs, as the CPU reports them. */
LH_ISA_FN const char *lh_isa_needs(int isa) {
    static const char *const needs[LH_ISA_COUNT] = {
        "nothing", "avx2, fma, f16c", "avx2, fma, f16c, avx512f, avx512vl, avx512bw, avx512dq",
        "avx2, fma, f16c, avx512f, avx512vl, avx512bw, avx512dq, avx512bf16"};
    return isa >= 0 && isa < LH_ISA_COUNT ? needs[isa] : (const char *)0;
}

/* Bit t set: this build and CPU run target t (LH_ISA_PORTABLE always). */
LH_ISA_FN int lh_isa_supported(void) {
    int mask = 1 << LH_ISA_PORTABLE;
#if LH_ISA_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c")))
        return mask;
    mask |= 1 << LH_ISA_AVX2;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")))
        return mask;
    mask |= 1 << LH_ISA_AVX512;
    if (__builtin_cpu_supports("avx512bf16"))
        mask |= 1 << LH_ISA_AVX512BF16;
#endif
    return mask;
}

/* The highest target this build and CPU run. */
LH_ISA_FN int lh_isa_best(void) {
    int mask = lh_isa_supported(), t;
    for (t = LH_ISA_COUNT - 1; t > 0; t--)
        if (mask & (1 << t))
            return t;
    return LH_ISA_PORTABLE;
}

/* The owner's writes of its cell (its reads are lh_isa_active, attached to it). */
LH_ISA_FN void lh_isa_store(int *cell, int isa) { __atomic_store_n(cell, isa, __ATOMIC_RELAXED); }

/* This module's view of the process's target: the owner's cell once attached. */
static const int *lh_isa_cell = (const int *)0;
static int lh_isa_fallback = -1;

LH_ISA_FN void lh_isa_attach(const int *cell) {
    __atomic_store_n(&lh_isa_cell, cell, __ATOMIC_RELEASE);
}

/* The active target. */
static inline int lh_isa_active(void) {
    const int *cell = __atomic_load_n(&lh_isa_cell, __ATOMIC_ACQUIRE);
    int t;
    if (cell != (const int *)0)
        return __atomic_load_n(cell, __ATOMIC_RELAXED);
    t = __atomic_load_n(&lh_isa_fallback, __ATOMIC_RELAXED);
    if (t < 0) {
        t = lh_isa_best();
        __atomic_store_n(&lh_isa_fallback, t, __ATOMIC_RELAXED);
    }
    return t;
}

#endif /* LORAHOOK_ISA_H */
