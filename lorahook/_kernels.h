/* The kernels' C helpers: per-thread scratch memory (_scratch.h), which BLAS
 * file runs, and DoRA's affine step.
 *
 *   void   lorahook_find_blas(void *blas_caller);  fills lorahook_blas_path
 *
 * Static, touching no Python object: callable without the GIL.  Included by
 * lorahook/_kernels.pyx only.
 */
#ifndef LORAHOOK_KERNELS_H
#define LORAHOOK_KERNELS_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>

#include "_scratch.h"

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
