/* Stacked LoRA pairs on the rows of one step, in the rows' own dtype, on an
 * OpenMP team the caller hands in (or on the calling thread).
 *
 * For every output slice i of a projection and every row r of slot s:
 *
 *     t          = scale * A_i[s][:k] @ x[r]            (k = ranks_i[s])
 *     y[r, cols_i] (+)= Bt_i[s][:k].T @ t
 *
 * A slot's A and Bt are found through a pointer per slot: rows of one stacked
 * tensor (an engine's slots) or an adapter's own tensors, wherever they live.
 *
 * x, y, A and Bt share one element kind: float32, float16 or bfloat16.  A
 * 16-bit value is widened in registers as it is loaded (a stripe of W values
 * at a time); the products and sums run in float32; an output element is
 * rounded once, when it is stored (to nearest even, NaNs quiet -- the rules of
 * halfconv.h).  No pass converts a whole activation or weight.
 *
 * Or A and Bt are int8 (lh_pairs.w8), whatever the rows' kind, with a float32
 * scale per row of A (SA) and per column of Bt (SB), slot by slot:
 * t = scale * SA[s][j] * (A8[s][j] . x), y (+)= SB[s] * (Bt8[s].T @ t).  int8
 * values are widened in registers as they are loaded, like 16-bit ones.
 *
 * Work is split in two phases over the team: the first (t for every covered
 * row) by rows, the second (the outputs) by blocks of 16 columns, so that a
 * weight byte is read once per call and every output element is written by
 * one thread.  Each value is computed in the same order whichever thread
 * computes it, so results do not depend on the team's size, and are the same
 * from run to run.
 *
 * The team is an OpenMP runtime already loaded in the process (GOMP ABI,
 * which GNU libgomp, LLVM libomp and Intel libiomp5 all export): this file
 * finds it, it never loads one, and nothing here starts a thread.
 *
 * One build of the kernel per instruction-set target (isa.h), run by the
 * process's target: "avx512bf16" (bfloat16 first products as the CPU's
 * bfloat16 dot products with float32 sums), "avx512" (16 values a stripe),
 * "avx2" (AVX2 + FMA + F16C, 8) and "portable" (8, vectorised as the compiler
 * can).  Sums are in one order per build: a build's results are the same from
 * run to run, and may differ from another build's in the last bits.
 */
#ifndef LORAHOOK_PAIRS_H
#define LORAHOOK_PAIRS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>

#include "halfconv.h"

/* element kinds, as lorahook._core.checks' ROWS_* */
#define LH_P_F32 0
#define LH_P_F16 1
#define LH_P_BF16 2
#define LH_P_I8 3          /* int8 weights (with their scales), never rows */

#define LH_P_MAX_SLICES 8
#define LH_P_COLS 16       /* the column block of the second phase */
#define LH_P_RB1 4         /* rows per block, first phase */
#define LH_P_RB2 8         /* rows per block, second phase */

typedef struct {
    const char *const *A;   /* per slot: its (ranks[s], d_in) rows, row-major (NULL: rank 0) */
    const char *const *Bt;  /* per slot: B transposed, (ranks[s], d_out), row-major */
    const float *const *SA; /* int8 weights: per slot, a scale per row of A (ranks[s]) */
    const float *const *SB; /* and one per column of Bt (d_out) */
    const int32_t *ranks;   /* (slots,), each in [0, rmax] */
    int rmax;
    int d_out;
    ptrdiff_t col;          /* the slice's first column in y */
    ptrdiff_t t_off;        /* the slice's t in the scratch: (rmax, n_covered), t[j][position] */
    ptrdiff_t blocks;       /* ceil(d_out / LH_P_COLS) */
} lh_slice;

typedef struct {
    const int *order;            /* rows by slot */
    const ptrdiff_t *starts;     /* slot s: order[starts[s]:starts[s+1]] */
    ptrdiff_t n_slots;           /* slots to visit (the highest with rows + 1) */
    ptrdiff_t n_covered;         /* starts[n_slots] */
    const char *X;
    ptrdiff_t ldx;               /* elements */
    char *Y;
    ptrdiff_t ldy;
    int d_in;
    int kind;
    int w8;                      /* A and Bt are int8 with their scales */
    int add;
    float scale;
    int n_slices;
    lh_slice slices[LH_P_MAX_SLICES];
    float *T;                    /* scratch: sum over slices of n_covered * rmax */
} lh_pairs;

/* ------------------------------------------------------------------ */
/* The OpenMP team.                                                    */

typedef struct {
    void (*parallel)(void (*fn)(void *), void *data, unsigned n, unsigned flags);
    void (*barrier)(void);
    int (*thread_num)(void);
    int (*num_threads)(void);
    int n;                       /* threads to ask for */
    char library[512];           /* the runtime's file */
} lh_team;

/* Fill `t` from an OpenMP runtime already loaded in this process; 0 on success,
   -1 when none is loaded (nothing is loaded here: RTLD_NOLOAD). */
static int lh_team_find(lh_team *t) {
    static const char *names[] = {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5",
                                  "libgomp.1.dylib", "libomp.dylib", NULL};
    void *sym = NULL, *handle = NULL;
    Dl_info info;
    int i;
    memset(t, 0, sizeof *t);
    /* the runtime in the global scope (vLLM preloads torch's libgomp) */
    sym = dlsym(RTLD_DEFAULT, "GOMP_parallel");
    if (sym != NULL && dladdr(sym, &info) && info.dli_fname != NULL)
        handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    /* else one loaded by a library, as torch loads its own */
    for (i = 0; handle == NULL && names[i] != NULL; i++)
        handle = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
    if (handle == NULL)
        return -1;
    *(void **)&t->parallel = dlsym(handle, "GOMP_parallel");
    *(void **)&t->barrier = dlsym(handle, "GOMP_barrier");
    *(void **)&t->thread_num = dlsym(handle, "omp_get_thread_num");
    *(void **)&t->num_threads = dlsym(handle, "omp_get_num_threads");
    if (t->parallel == NULL || t->barrier == NULL || t->thread_num == NULL ||
        t->num_threads == NULL) {
        dlclose(handle);
        memset(t, 0, sizeof *t);
        return -1;
    }
    if (dladdr(*(void **)&t->parallel, &info) && info.dli_fname != NULL) {
        strncpy(t->library, info.dli_fname, sizeof t->library - 1);
        t->library[sizeof t->library - 1] = '\0';
    }
    /* the handle is kept: the runtime stays loaded while a team refers to it */
    return 0;
}

/* ------------------------------------------------------------------ */
/* The kernel, built once per instruction set from pairs_body.h.      */

#define LH_P_SUFFIX portable
#define LH_P_W 8
#define LH_P_ISA 0
#include "pairs_body.h"
#undef LH_P_SUFFIX
#undef LH_P_W
#undef LH_P_ISA

#if LH_ISA_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LH_P_SUFFIX avx2
#define LH_P_W 8
#define LH_P_ISA 1
#include "pairs_body.h"
#undef LH_P_SUFFIX
#undef LH_P_W
#undef LH_P_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define LH_P_SUFFIX avx512
#define LH_P_W 16
#define LH_P_ISA 2
#include "pairs_body.h"
#undef LH_P_SUFFIX
#undef LH_P_W
#undef LH_P_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")
#define LH_P_SUFFIX avx512bf16
#define LH_P_W 16
#define LH_P_ISA 3
#include "pairs_body.h"
#undef LH_P_SUFFIX
#undef LH_P_W
#undef LH_P_ISA
#pragma GCC pop_options
#endif

typedef void (*lh_part_fn)(const lh_pairs *, int, int, void (*)(void));

/* The build of a target (isa.h); builds a target has none of (no x86 code) are portable. */
static lh_part_fn lh_pairs_part_for(int isa) {
#if LH_ISA_X86
    switch (isa) {
    case LH_ISA_AVX512BF16: return lh_pairs_part_avx512bf16;
    case LH_ISA_AVX512: return lh_pairs_part_avx512;
    case LH_ISA_AVX2: return lh_pairs_part_avx2;
    default: break;
    }
#endif
    (void)isa;
    return lh_pairs_part_portable;
}

typedef struct {
    const lh_pairs *call;
    const lh_team *team;
    lh_part_fn part;
} lh_team_job;

static void lh_team_body(void *data) {
    const lh_team_job *job = (const lh_team_job *)data;
    job->part(job->call, job->team->thread_num(), job->team->num_threads(), job->team->barrier);
}

/* Run a call with the process's target's build: on the team when one is given with more
   than one thread, else here. */
static void lh_pairs_run(const lh_pairs *call, const lh_team *team) {
    lh_part_fn part = lh_pairs_part_for(lh_isa_active());
    lh_team_job job;
    if (team == NULL || team->n <= 1) {
        part(call, 0, 1, NULL);
        return;
    }
    job.call = call;
    job.team = team;
    job.part = part;
    team->parallel(lh_team_body, &job, (unsigned)team->n, 0);
}

#endif /* LORAHOOK_PAIRS_H */
