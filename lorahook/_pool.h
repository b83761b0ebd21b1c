/* lorahook's own helper threads for large batched calls.
 *
 * One call hands the pool a task function and an argument; the caller and up
 * to `want` helper threads then run `task(arg)` at the same time, and the
 * task itself takes chunks of work from a shared counter (see
 * lorahook_next_chunk), so a helper that wakes late simply finds less to do.
 * lorahook_pool_run returns when every thread that joined has finished.
 *
 * Helpers never spin: between jobs they sleep on a condition variable, so an
 * idle pool costs the machine nothing (unlike a BLAS pool, whose workers spin
 * for a while after each call and compete with the next call of another
 * library).  One job runs at a time; a caller that finds the pool busy runs
 * the task alone on its own thread, which is how several Python threads
 * calling at once each keep a core without oversubscribing the machine.
 *
 * After fork() the child has no helper threads; the pool notices and starts
 * new ones when it is next used.
 */
#ifndef LORAHOOK_POOL_H
#define LORAHOOK_POOL_H

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

#define LORAHOOK_POOL_MAX 64

typedef void (*lorahook_task)(void *arg);

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;   /* helpers wait here for a job */
    pthread_cond_t done_cv;   /* the caller waits here for joined helpers */
    int started;              /* helper threads alive in this process */
    int busy;                 /* a caller owns the pool */
    int slots;                /* helpers that may still join the current job */
    int active;               /* helpers running the current job */
    unsigned long gen;        /* job number, so a helper joins each job once */
    lorahook_task task;
    void *arg;
} lorahook_pool_t;

static lorahook_pool_t lorahook_pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
    0, 0, 0, 0, 0, NULL, NULL};
static pthread_once_t lorahook_pool_once = PTHREAD_ONCE_INIT;
static Py_ssize_t lorahook_in_flight = 0;

static void lorahook_pool_prefork(void) { pthread_mutex_lock(&lorahook_pool.mu); }
static void lorahook_pool_postfork_parent(void) { pthread_mutex_unlock(&lorahook_pool.mu); }
static void lorahook_pool_postfork_child(void) {
    /* Only the forking thread exists in the child: no helpers, no job, and
       no kernel call in flight (a call another thread was making in the
       parent does not exist here).  The mutex is held (prefork) by this very
       thread, so it is safe to reset. */
    pthread_cond_t fresh = PTHREAD_COND_INITIALIZER;
    lorahook_pool.work_cv = fresh;
    lorahook_pool.done_cv = fresh;
    lorahook_pool.started = 0;
    lorahook_pool.busy = 0;
    lorahook_pool.slots = 0;
    lorahook_pool.active = 0;
    lorahook_pool.task = NULL;
    lorahook_pool.arg = NULL;
    __atomic_store_n(&lorahook_in_flight, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lorahook_pool.mu);
}
static void lorahook_pool_init(void) {
    pthread_atfork(lorahook_pool_prefork, lorahook_pool_postfork_parent,
                   lorahook_pool_postfork_child);
}

static void *lorahook_pool_helper(void *unused) {
    unsigned long seen = 0;
    lorahook_task task;
    void *arg;
    (void)unused;
    pthread_mutex_lock(&lorahook_pool.mu);
    for (;;) {
        while (lorahook_pool.slots == 0 || lorahook_pool.gen == seen)
            pthread_cond_wait(&lorahook_pool.work_cv, &lorahook_pool.mu);
        seen = lorahook_pool.gen;
        lorahook_pool.slots--;
        lorahook_pool.active++;
        task = lorahook_pool.task;
        arg = lorahook_pool.arg;
        pthread_mutex_unlock(&lorahook_pool.mu);
        task(arg);
        pthread_mutex_lock(&lorahook_pool.mu);
        if (--lorahook_pool.active == 0)
            pthread_cond_signal(&lorahook_pool.done_cv);
    }
    return NULL;
}

/* Start helpers until `want` exist; call with mu held.  Helpers block the
   asynchronous signals, so those keep going to the threads the program knows
   about; faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL) and SIGABRT stay
   unblocked, so a crash on a helper still reaches faulthandler. */
static void lorahook_pool_grow(int want) {
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_t tid;
    if (want > LORAHOOK_POOL_MAX) want = LORAHOOK_POOL_MAX;
    if (lorahook_pool.started >= want) return;
    if (pthread_attr_init(&attr) != 0) return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGABRT);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (lorahook_pool.started < want) {
        if (pthread_create(&tid, &attr, lorahook_pool_helper, NULL) != 0)
            break;  /* fewer helpers: the caller does the rest of the work */
        lorahook_pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

/* Run caller_task(arg) on the calling thread and helper_task(arg) on up to
   `want` helpers.  Returns the number of helpers offered the job (0 when the
   pool was busy: then only caller_task runs). */
static int lorahook_pool_run(lorahook_task caller_task, lorahook_task helper_task,
                             void *arg, int want) {
    int offered;
    pthread_once(&lorahook_pool_once, lorahook_pool_init);
    pthread_mutex_lock(&lorahook_pool.mu);
    if (want < 1 || lorahook_pool.busy) {
        pthread_mutex_unlock(&lorahook_pool.mu);
        caller_task(arg);
        return 0;
    }
    lorahook_pool_grow(want);
    offered = lorahook_pool.started < want ? lorahook_pool.started : want;
    lorahook_pool.busy = 1;
    lorahook_pool.task = helper_task;
    lorahook_pool.arg = arg;
    lorahook_pool.slots = offered;
    lorahook_pool.gen++;
    if (offered > 0)
        pthread_cond_broadcast(&lorahook_pool.work_cv);
    pthread_mutex_unlock(&lorahook_pool.mu);

    caller_task(arg);

    pthread_mutex_lock(&lorahook_pool.mu);
    lorahook_pool.slots = 0;  /* helpers that have not woken yet stay out */
    while (lorahook_pool.active > 0)
        pthread_cond_wait(&lorahook_pool.done_cv, &lorahook_pool.mu);
    lorahook_pool.busy = 0;
    lorahook_pool.task = NULL;
    lorahook_pool.arg = NULL;
    pthread_mutex_unlock(&lorahook_pool.mu);
    return offered;
}

/* Helper threads alive (for tests and diagnostics). */
static int lorahook_pool_started(void) {
    int n;
    pthread_mutex_lock(&lorahook_pool.mu);
    n = lorahook_pool.started;
    pthread_mutex_unlock(&lorahook_pool.mu);
    return n;
}

/* Kernel calls running right now, on any thread.  A helper takes another
   chunk only while the call it helps is the only one: when a second Python
   thread starts calling lorahook, each call keeps to its own thread instead
   of three threads sharing two cores.  (Defined with the pool state.) */
static void lorahook_enter(void) { __atomic_add_fetch(&lorahook_in_flight, 1, __ATOMIC_RELAXED); }
static void lorahook_leave(void) { __atomic_sub_fetch(&lorahook_in_flight, 1, __ATOMIC_RELAXED); }
static Py_ssize_t lorahook_calls_in_flight(void) {
    return __atomic_load_n(&lorahook_in_flight, __ATOMIC_RELAXED);
}

/* Work items run by helper threads in this process (diagnostics, tests). */
static Py_ssize_t lorahook_helper_items = 0;
static void lorahook_count_helper_item(void) {
    __atomic_add_fetch(&lorahook_helper_items, 1, __ATOMIC_RELAXED);
}
static Py_ssize_t lorahook_helper_items_done(void) {
    return __atomic_load_n(&lorahook_helper_items, __ATOMIC_RELAXED);
}

/* Take the next chunk index of a job: an atomic fetch-and-add. */
static Py_ssize_t lorahook_next_chunk(Py_ssize_t *counter) {
    return __atomic_fetch_add(counter, (Py_ssize_t)1, __ATOMIC_RELAXED);
}

static void lorahook_store_int(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* The thread-count getter of the BLAS the kernels call, or NULL when unknown.
   Work is split only while that BLAS runs one thread per call, so lorahook's
   threads never multiply with BLAS threads. */
typedef int (*lorahook_int_getter)(void);
static lorahook_int_getter lorahook_blas_threads_fn = NULL;

/* The file of the BLAS the kernels call ("" when unknown), for threadpoolctl. */
static char lorahook_blas_path[4096] = "";

/* Find the BLAS library and OpenBLAS's thread-count getter from any function
   of the module that calls BLAS (scipy.linalg.cython_blas): the dynamic
   loader says which file holds that function, and a symbol lookup through
   that file's handle searches it and the libraries it was linked against,
   which is where its BLAS is.  The library is the file holding sgemm. */
static void lorahook_find_blas(void *blas_caller) {
    static const char *getters[] = {
        "scipy_openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
        "openblas_get_num_threads", "openblas_get_num_threads64_", NULL};
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
    for (i = 0; getters[i] != NULL; i++) {
        sym = dlsym(handle, getters[i]);
        if (sym != NULL) {
            lorahook_blas_threads_fn = (lorahook_int_getter)sym;
            break;
        }
    }
    for (i = 0; sgemms[i] != NULL; i++) {
        sym = dlsym(handle, sgemms[i]);
        if (sym != NULL && dladdr(sym, &lib) && lib.dli_fname != NULL
                && strcmp(lib.dli_fname, caller.dli_fname) != 0
                && strlen(lib.dli_fname) < sizeof(lorahook_blas_path)) {
            strcpy(lorahook_blas_path, lib.dli_fname);
            break;
        }
    }
    /* the handle is kept: the library stays loaded for as long as SciPy is */
}

/* SciPy BLAS threads, or 0 when the library has no getter lorahook knows. */
static int lorahook_blas_threads_known(void) {
    return lorahook_blas_threads_fn == NULL ? 0 : lorahook_blas_threads_fn();
}
static int lorahook_blas_threads(void) {
    return lorahook_blas_threads_fn == NULL ? 1 : lorahook_blas_threads_fn();
}

#endif
