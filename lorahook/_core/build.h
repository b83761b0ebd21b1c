/* What the build was asked for (setup.py defines it; 0 when built otherwise). */
#ifndef LORAHOOK_BUILD_H
#define LORAHOOK_BUILD_H

#ifndef LORAHOOK_DEBUG_BUILD
#define LORAHOOK_DEBUG_BUILD 0
#endif

#endif /* LORAHOOK_BUILD_H */
