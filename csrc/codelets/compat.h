/* Small shims between the StarPU versions we build against (Debian's 1.3.10 and the
 * module-provided 1.4 of clusters). Everything version-dependent lives here. */
#ifndef SL_COMPAT_H
#define SL_COMPAT_H
#include <starpu.h>

#if STARPU_MAJOR_VERSION > 1 || (STARPU_MAJOR_VERSION == 1 && STARPU_MINOR_VERSION >= 4)
#define SL_STARPU_14 1
#else
#define SL_STARPU_14 0
#endif

/* Parallel workers: 1.4 calls them "parallel workers" (STARPU_PARALLEL_WORKER), 1.3 "clusters"
 * (STARPU_CLUSTER). Debian's 1.3 has neither: we then use combined workers and FORKJOIN tasks. */
#if defined(STARPU_PARALLEL_WORKER) || defined(STARPU_CLUSTER)
#define SL_HAVE_PARALLEL_WORKERS 1
#else
#define SL_HAVE_PARALLEL_WORKERS 0
#endif

#endif
