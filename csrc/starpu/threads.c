/* The cores a task owns: sizing the OpenMP team and BLAS of the thread running a task, and
 * binding the team's threads. sl_start tells the partition once (sl_codelets_set_partition):
 * its mechanism and K, the cores of a worker, which every task reads (a FORKJOIN codelet run
 * sequentially on a basic worker: 1); binding needs the cores themselves: a team worker's
 * group, a FORKJOIN task's combined worker (StarPU binds a parallel worker's team). */
#define _GNU_SOURCE
#include <omp.h>
#include "internal.h"

/* Binds thread t (t > 0) of the calling thread's libgomp pool of cores_per_worker threads to
 * core cpus[t]. */
static void bind_pool(const int *cpus, int cores_per_worker)
{
#pragma omp parallel num_threads(cores_per_worker)
	{
		int t = omp_get_thread_num();
		if (t > 0)
			starpu_sched_ctx_bind_current_thread_to_cpuid(cpus[t]);
	}
}

/* ---- FORKJOIN: a combined worker of cores_per_worker cores ---- */

/* Bind each thread of a team of cores_per_worker threads to one core of the combined worker
 * running the task. Why: libgomp's pool threads keep the CPU mask they were created with, and StarPU only
 * rebinds the team's master thread (to the union of the cores) for a FORKJOIN task, so two
 * team threads could otherwise share a core. The pool threads of a master thread persist, so
 * they are bound once per (master thread, combined worker); the master every time, because
 * StarPU restores its own single-core binding after each parallel task. */
static __thread int bound_combined = -1;

static void bind_team(int cores_per_worker)
{
	int cid = starpu_combined_worker_get_id();
	int size = 0, *ids = NULL;
	if (cid < 0 || starpu_combined_worker_get_description(cid, &size, &ids) != 0 ||
	    size < cores_per_worker)
		return;
	if (cid != bound_combined) {
		int cpus[SL_MAX_GROUP];
		for (int t = 0; t < cores_per_worker && t < SL_MAX_GROUP; t++)
			cpus[t] = starpu_worker_get_bindid(ids[t]);
		bind_pool(cpus, cores_per_worker);
		bound_combined = cid;
	}
	starpu_sched_ctx_bind_current_thread_to_cpuid(starpu_worker_get_bindid(ids[0]));
}

/* ---- the partition, as started ---- */

static struct {
	int kcore;	      /* SL_KCORE_*; SL_KCORE_SINGLE when stopped */
	int cores_per_worker; /* K */
	int groups[STARPU_NMAXWORKERS][SL_MAX_GROUP]; /* team mode: each CPU worker's cores */
} team = { .kcore = SL_KCORE_SINGLE, .cores_per_worker = 1 };
static int cpu_rank[STARPU_NMAXWORKERS]; /* StarPU worker id -> its rank among the CPU workers */
static __thread int team_bound; /* this worker's team threads are bound (once) */

void sl_codelets_set_partition(int kcore, int nworkers, int cores_per_worker, const int *cores)
{
	team.kcore = kcore;
	team.cores_per_worker = cores_per_worker;
	if (kcore != SL_KCORE_TEAM)
		nworkers = 0;
	int ids[STARPU_NMAXWORKERS];
	int ncpu = nworkers > 0 ? starpu_worker_get_ids_by_type(STARPU_CPU_WORKER, ids,
								STARPU_NMAXWORKERS) :
				  0;
	for (int i = 0; i < STARPU_NMAXWORKERS; i++)
		cpu_rank[i] = -1;
	for (int i = 0; i < ncpu; i++)
		cpu_rank[ids[i]] = i;
	for (int w = 0; w < nworkers && w < STARPU_NMAXWORKERS; w++)
		for (int t = 0; t < cores_per_worker && t < SL_MAX_GROUP; t++)
			team.groups[w][t] = cores ? cores[w * cores_per_worker + t]
						  : w * cores_per_worker + t;
}

/* libgomp keeps a pool of team threads per master thread: binding them once per worker
 * thread is enough, and the StarPU worker thread itself stays on its group's first core. */
static void bind_team_group(int cores_per_worker)
{
	if (team_bound)
		return;
	int id = starpu_worker_get_id();
	int w = id >= 0 && id < STARPU_NMAXWORKERS ? cpu_rank[id] : -1;
	if (w < 0)
		return;
	bind_pool(team.groups[w], cores_per_worker);
	team_bound = 1;
}

/* ---- per task ---- */

/* K, the cores of a worker as sl_start was told (team.cores_per_worker), is the task's team;
 * only a FORKJOIN codelet asks StarPU where it landed: on a combined worker (of exactly K
 * cores: STARPU_MIN/MAX_WORKERSIZE) or, run sequentially, on a basic worker (1 core). */
int sl_task_threads(void)
{
	int cores_per_worker = team.cores_per_worker;
	switch (team.kcore) {
	case SL_KCORE_PARALLEL: /* StarPU sized and bound the parallel worker's OpenMP team */
		blas_set_threads(cores_per_worker);
		break;
	case SL_KCORE_TEAM:
		kernels_set_threads(cores_per_worker);
		bind_team_group(cores_per_worker);
		break;
	case SL_KCORE_FORKJOIN:
		if (starpu_combined_worker_get_size() != cores_per_worker)
			cores_per_worker = 1;
		kernels_set_threads(cores_per_worker);
		if (cores_per_worker > 1)
			bind_team(cores_per_worker);
		break;
	default: /* one core per worker */
		kernels_set_threads(cores_per_worker);
	}
	return cores_per_worker;
}
