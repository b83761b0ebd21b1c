/* Which BLAS file the kernels run:
 *
 *   void lorahook_find_blas(void *blas_caller);  fills lorahook_blas_path
 *
 * Touching no Python object.  Included by lorahook/_segments.pyx only.
 */
#ifndef LORAHOOK_BLAS_PATH_H
#define LORAHOOK_BLAS_PATH_H

#include <string.h>
#include <dlfcn.h>

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

#endif /* LORAHOOK_BLAS_PATH_H */
