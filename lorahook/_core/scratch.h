/* Per-thread scratch memory for the kernels:
 *
 *   float *lorahook_scratch_area(size_t n, int area, int *owned);
 *
 * Static, touching no Python object: callable without the GIL.  The cache is
 * per translation unit: each compiled module that includes this header keeps
 * its own areas, laid out the same way in every module (the LH_SCRATCH_*
 * areas below).
 */
#ifndef LORAHOOK_SCRATCH_H
#define LORAHOOK_SCRATCH_H

#include <pthread.h>
#include <stdlib.h>

/* A per-thread scratch buffer, reused across calls so that the batched
   kernels do not page-fault on a fresh temporary every projection.  Freed
   by the pthread key destructor when the thread exits.  (Thread-local
   storage only: no thread is started here.) */
#define LORAHOOK_SCRATCH_CACHE_FLOATS ((size_t)1 << 20)

/* Three independent areas per thread, one layout in every module; a kernel
   that runs inside another one uses an area the outer one does not. */
enum {
    LH_SCRATCH_WIDENED = 0,   /* 16-bit rows widened to float32 around a float32 kernel */
    LH_SCRATCH_PRODUCTS = 1,  /* a kernel's gathered rows and its products */
    LH_SCRATCH_WEIGHTS = 2    /* 16-bit adapter factors widened to float32 */
};
#define LORAHOOK_SCRATCH_SLOTS 3

/* Rows per chunk of a kernel that gathers its input rows or scatters its
   output rows through scratch: the chunk's rows stay in cache between the
   products and the scatter. */
#define LH_GATHER_CHUNK_ROWS 256

/* Floats of the block of a chunk's output rows written back through scratch
   (a block of columns of every row of the chunk), kept in cache between the
   read, the product and the write; and the narrowest block. */
#define LH_BLOCK_FLOATS ((size_t)1 << 16)
#define LH_BLOCK_MIN_COLS 16
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
static float *lorahook_scratch_area(size_t n, int area, int *owned) {
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
    if (b->len[area] < n) {
        float *p = (float *)malloc(n * sizeof(float));
        if (p == NULL) return NULL;
        free(b->data[area]);
        b->data[area] = p;
        b->len[area] = n;
    }
    return b->data[area];
}

#endif /* LORAHOOK_SCRATCH_H */
