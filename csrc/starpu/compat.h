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
#if defined(STARPU_PARALLEL_WORKER)
#include <starpu_parallel_worker.h>
#define SL_HAVE_PARALLEL_WORKERS 1
typedef struct starpu_parallel_worker_config sl_parallel_workers;
/* n parallel workers over the machine, each running tasks with an OpenMP team of its cores */
#define sl_parallel_workers_init(n)                                                                \
	starpu_parallel_worker_init(HWLOC_OBJ_MACHINE, STARPU_PARALLEL_WORKER_NB, (n),             \
				    STARPU_PARALLEL_WORKER_TYPE, STARPU_PARALLEL_WORKER_OPENMP, 0)
#define sl_parallel_workers_shutdown(pw) starpu_parallel_worker_shutdown(pw)
#elif defined(STARPU_CLUSTER)
#include <starpu_clusters.h>
#define SL_HAVE_PARALLEL_WORKERS 1
typedef struct starpu_cluster_machine sl_parallel_workers;
#define sl_parallel_workers_init(n)                                                                \
	starpu_cluster_machine(HWLOC_OBJ_MACHINE, STARPU_CLUSTER_NB, (n), STARPU_CLUSTER_TYPE,     \
			       STARPU_CLUSTER_OPENMP, 0)
#define sl_parallel_workers_shutdown(pw) starpu_uncluster_machine(pw)
#else
#define SL_HAVE_PARALLEL_WORKERS 0
#endif

#endif
