/* The kernels' C helpers: per-thread scratch memory, and which BLAS file runs.
 *
 *   float *lorahook_scratch_slot(size_t n, int slot, int *owned);
 *   void   lorahook_find_blas(void *blas_caller);  fills lorahook_blas_path
 *
 * Static, touching no Python object: callable without the GIL.  Included by
 * lorahook/_kernels.pyx only (the cache is per translation unit).
 */
#ifndef LORAHOOK_KERNELS_H
#define LORAHOOK_KERNELS_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>

/* A per-thread scratch buffer, reused across calls so that the batched
   kernels do not page-fault on a fresh temporary every projection.  Freed
   by the pthread key destructor when the thread exits.  (Thread-local
   storage only: no thread is started here.) */
#define LORAHOOK_SCRATCH_CACHE_FLOATS ((size_t)1 << 20)

/* Three independent areas per thread: 0 for the float32 kernels, 1 for
   half-precision rows widened to float32, 2 for half-precision adapter
   weights widened to float32. */
#define LORAHOOK_SCRATCH_SLOTS 3
typedef struct { float *data[LORAHOOK_SCRATCH_SLOTS]; size_t len[LORAHOOK_SCRATCH_SLOTS]; } lorahook_buf;
static pthread_key_t lorahook_key;
static pthread_once_t lorahook_once = PTHREAD_ONCE_INIT;
static int lorahook_key_ok = 0;

static void lorahook_buf_free(void *p) {
    lorahook_buf *b = (lorahook_buf *)p;
    int i;
    if (b != NULL) {
        for (i = 0; i < LORAHOOK_SCRATCH_SLOTS; i++) free(b->data[i]);
        free(b);
    }
}
static void lorahook_make_key(void) {
    lorahook_key_ok = (pthread_key_create(&lorahook_key, lorahook_buf_free) == 0);
}
/* Returns a buffer of at least n floats, or NULL when out of memory.
   *owned is set to 1 when the caller must free() it (requests larger
   than the cache, or no thread-local storage available). */
static float *lorahook_scratch_slot(size_t n, int slot, int *owned) {
    lorahook_buf *b;
    *owned = 0;
    if (n == 0) n = 1;
    pthread_once(&lorahook_once, lorahook_make_key);
    if (!lorahook_key_ok || n > LORAHOOK_SCRATCH_CACHE_FLOATS) {
        *owned = 1;
        return (float *)malloc(n * sizeof(float));
    }
    b = (lorahook_buf *)pthread_getspecific(lorahook_key);
    if (b == NULL) {
        b = (lorahook_buf *)calloc(1, sizeof(lorahook_buf));
        if (b == NULL) return NULL;
        if (pthread_setspecific(lorahook_key, b) != 0) { free(b); *owned = 1;
            return (float *)malloc(n * sizeof(float)); }
    }
    if (b->len[slot] < n) {
        float *p = (float *)malloc(n * sizeof(float));
        if (p == NULL) return NULL;
        free(b->data[slot]);
        b->data[slot] = p;
        b->len[slot] = n;
    }
    return b->data[slot];
}

/* The file of the BLAS library the kernels call ("" when unknown): the
   dynamic loader says which file holds a function of the module that
   calls BLAS (scipy.linalg.cython_blas); a symbol lookup through that
   file's handle searches it and the libraries it links, and the file
   holding sgemm is the BLAS.  Read-only: nothing is changed. */
static char lorahook_blas_path[4096] = "";
static void lorahook_find_blas(void *blas_caller) {
    static const char *sgemms[] = {
        "scipy_sgemm_", "sgemm_", "sgemm", "scipy_sgemm_64_", "sgemm_64_", NULL};
    Dl_info caller, lib;
    void *handle, *sym;
    int i;
    if (blas_caller == NULL || !dladdr(blas_caller, &caller) || caller.dli_fname == NULL)
        return;
    handle = dlopen(caller.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == NULL)
        return;
    for (i = 0; sgemms[i] != NULL; i++) {
        sym = dlsym(handle, sgemms[i]);
        if (sym != NULL && dladdr(sym, &lib) && lib.dli_fname != NULL
                && strcmp(lib.dli_fname, caller.dli_fname) != 0
                && strlen(lib.dli_fname) < sizeof(lorahook_blas_path)) {
            strcpy(lorahook_blas_path, lib.dli_fname);
            break;
        }
    }
    dlclose(handle);  /* RTLD_NOLOAD took a reference; give it back */
}

/* DoRA's step before the delta, y = m * y + c, over n values: the arrays
   never overlap (restrict), so the compiler vectorizes the loop. */
static void lorahook_affine(float *restrict y, const float *restrict m,
                            const float *restrict c, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) y[i] = m[i] * y[i] + c[i];
}

#endif /* LORAHOOK_KERNELS_H */
