/* DoRA's step before the delta, y = m * y + c, over n values.
 *
 * The arrays never overlap (restrict), so the compiler vectorizes the loop;
 * static, touching no Python object: callable without the GIL.
 */
#ifndef LORAHOOK_AFFINE_H
#define LORAHOOK_AFFINE_H

#include <stddef.h>

static inline void lorahook_affine(float *restrict y, const float *restrict m,
                                   const float *restrict c, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        y[i] = m[i] * y[i] + c[i];
}

#endif /* LORAHOOK_AFFINE_H */
