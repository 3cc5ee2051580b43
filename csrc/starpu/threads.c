/* The cores a task owns: sizing the OpenMP team and BLAS of the thread running a task, and
 * binding the team's threads, for each of the three ways a task gets k cores (FORKJOIN on a
 * combined worker, a team worker's group, a parallel worker). */
#define _GNU_SOURCE
#include <omp.h>
#include "internal.h"

/* Binds thread t (t > 0) of the calling thread's k-thread libgomp pool to core cpus[t]. */
static void bind_pool(const int *cpus, int k)
{
#pragma omp parallel num_threads(k)
	{
		int t = omp_get_thread_num();
		if (t > 0)
			starpu_sched_ctx_bind_current_thread_to_cpuid(cpus[t]);
	}
}

/* ---- FORKJOIN: a combined worker of k cores ---- */

/* Bind each thread of a k-thread team to one core of the combined worker running the task.
 * Why: libgomp's pool threads keep the CPU mask they were created with, and StarPU only
 * rebinds the team's master thread (to the union of the cores) for a FORKJOIN task, so two
 * team threads could otherwise share a core. The pool threads of a master thread persist, so
 * they are bound once per (master thread, combined worker); the master every time, because
 * StarPU restores its own single-core binding after each parallel task. */
static __thread int bound_combined = -1;

static void bind_team(int k)
{
	int cid = starpu_combined_worker_get_id();
	int size = 0, *ids = NULL;
	if (cid < 0 || starpu_combined_worker_get_description(cid, &size, &ids) != 0 || size < k)
		return;
	if (cid != bound_combined) {
		int cpus[SL_MAX_GROUP];
		for (int t = 0; t < k && t < SL_MAX_GROUP; t++)
			cpus[t] = starpu_worker_get_bindid(ids[t]);
		bind_pool(cpus, k);
		bound_combined = cid;
	}
	starpu_sched_ctx_bind_current_thread_to_cpuid(starpu_worker_get_bindid(ids[0]));
}

/* ---- parallel workers: the team is StarPU's ---- */

static int team_from_runtime;

void sl_codelets_set_team_from_runtime(int on) { team_from_runtime = on; }

/* ---- team mode: a worker owns a group of k cores ---- */

static int team_cores;
static int team_groups[STARPU_NMAXWORKERS][SL_MAX_GROUP];
static int cpu_rank[STARPU_NMAXWORKERS]; /* StarPU worker id -> its rank among the CPU workers */
static __thread int team_bound; /* this worker's team threads are bound (once) */

void sl_codelets_set_team_groups(int nworkers, int cores_per_worker, const int *cores)
{
	int k = cores_per_worker;
	team_cores = nworkers > 0 ? k : 0;
	int ids[STARPU_NMAXWORKERS];
	int ncpu = nworkers > 0 ? starpu_worker_get_ids_by_type(STARPU_CPU_WORKER, ids,
								STARPU_NMAXWORKERS) :
				  0;
	for (int i = 0; i < STARPU_NMAXWORKERS; i++)
		cpu_rank[i] = -1;
	for (int i = 0; i < ncpu; i++)
		cpu_rank[ids[i]] = i;
	for (int w = 0; w < nworkers && w < STARPU_NMAXWORKERS; w++)
		for (int t = 0; t < k && t < SL_MAX_GROUP; t++)
			team_groups[w][t] = cores ? cores[w * k + t] : w * k + t;
}

/* libgomp keeps a pool of team threads per master thread: binding them once per worker
 * thread is enough, and the StarPU worker thread itself stays on its group's first core. */
static void bind_team_group(int k)
{
	if (team_bound)
		return;
	int id = starpu_worker_get_id();
	int w = id >= 0 && id < STARPU_NMAXWORKERS ? cpu_rank[id] : -1;
	if (w < 0)
		return;
	bind_pool(team_groups[w], k);
	team_bound = 1;
}

/* ---- per task ---- */

int sl_task_threads(void)
{
	int k;
	if (team_from_runtime) {
		k = omp_get_max_threads(); /* the parallel worker's team, bound by StarPU */
		blas_set_threads(k);
	} else if (team_cores > 1) {
		k = team_cores;
		kernels_set_threads(k);
		bind_team_group(k);
	} else {
		k = starpu_combined_worker_get_size(); /* 1 on a basic worker */
		kernels_set_threads(k);
		if (k > 1)
			bind_team(k);
	}
	return k;
}
