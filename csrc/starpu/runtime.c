/* StarPU start/stop and data registration helpers called from Python (starpu_llm/runtime/starpu.py). */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#ifdef SL_HAVE_HWLOC
#include <hwloc.h>
#endif
#ifdef SL_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <starpu_cublas.h>
#endif

static int initialized;
#ifdef SL_HAVE_CUDA
static int cublas_on; /* starpu_cublas_init was called (CUDA workers run) */
#endif

#if SL_HAVE_PARALLEL_WORKERS
static sl_parallel_workers *parallel_workers;

/* Whether the n logical cores listed (NULL: 0..n-1) are all different. */
static int distinct_cores(const int *cores, int n)
{
	for (int i = 0; cores && i < n; i++)
		for (int j = 0; j < i; j++)
			if (cores[i] == cores[j])
				return 0;
	return 1;
}
#endif

/* Starts StarPU (StarPU-MPI when comm is given) for the partition nworkers x cores_per_worker
 * with the mechanism kcore (decided in Python: starpu_llm/plan/partition.py) and ncuda CUDA workers;
 * cores lists the partition's cores (NULL: 0..), then one core for each CUDA worker's thread.
 * See sl_api.h. attach: StarPU was started by someone else (starpupy) on the same partition:
 * only the set-up after init. */
static int start(int nworkers, int cores_per_worker, int kcore, const int *cores, int ncuda,
		 const char *sched, const void *comm, int attach)
{
	if (initialized)
		return -EALREADY;
	if (attach && (comm || !starpu_is_initialized() || sl_ooc_enabled() || ncuda))
		return -EINVAL;
	if (nworkers < 1 || cores_per_worker < 1 || ncuda < 0 ||
	    (cores_per_worker == 1) != (kcore == SL_KCORE_SINGLE))
		return -EINVAL;
#ifndef SL_HAVE_CUDA
	if (ncuda > 0)
		return -ENODEV; /* not a CUDA build */
#endif
	int ncpus = nworkers * cores_per_worker;
	int use_parallel_workers = kcore == SL_KCORE_PARALLEL, use_team = kcore == SL_KCORE_TEAM;
	if (use_parallel_workers) {
#if SL_HAVE_PARALLEL_WORKERS
		/* parallel workers (1.4) or clusters (1.3 built with them), made after init: a
		 * StarPU worker on each core, each core its own (an oversubscribed parallel worker
		 * runs no task on StarPU 1.4.12), no disk node (1.4.12 asserts when a parallel
		 * worker prefetches a task's data again), no GPUs (the scheduler must see the CPU
		 * and CUDA workers together). Python chose them under the same rules. */
		if (sl_ooc_enabled() || ncpus > STARPU_MAXCPUS || !distinct_cores(cores, ncpus) ||
		    ncuda > 0)
			return -EINVAL;
#else
		return -EINVAL;
#endif
	}
	struct starpu_conf conf;
	int ret = starpu_conf_init(&conf);
	if (ret)
		return ret;
	if (!attach) {
		/* the CUDA workers asked for, no other count (the variable overrides conf.ncuda) */
		char n[16];
		snprintf(n, sizeof n, "%d", ncuda);
		if (setenv("STARPU_NCUDA", n, 1) != 0)
			return -errno;
	}
	conf.ncpus = ncpus;
	conf.ncuda = ncuda;
	conf.nopencl = 0;
	if (sched && *sched)
		conf.sched_policy_name = sched;

	if (attach) {
		/* the starter set the conf from the same decisions (starpu_llm/runtime/starpupy_face.py) */
	} else if (use_team || kcore == SL_KCORE_SINGLE) {
		/* One StarPU worker on the first core of each group; its tasks' OpenMP team takes
		 * the group's other cores, which StarPU does not run workers on (one-core workers:
		 * each on its core; StarPU 1.3 would put worker w on the machine's w-th CPU,
		 * whatever this process's affinity, taskset's or a cpuset's). The CUDA workers'
		 * threads are bound first (they come first in StarPU's numbering), each to a core
		 * of the list, the one listed for it unless StarPU prefers another near its GPU (a
		 * group's first: that group's worker then takes the GPU's listed core); the
		 * groups' other cores are never in the list. */
		if (cores_per_worker > SL_MAX_GROUP || nworkers + ncuda > STARPU_NMAXWORKERS)
			return -EINVAL;
		conf.ncpus = nworkers;
		conf.use_explicit_workers_bindid = 1;
		for (int d = 0; d < ncuda; d++)
			conf.workers_bindid[d] = (unsigned)(cores ? cores[ncpus + d] : ncpus + d);
		for (int w = 0; w < nworkers; w++)
			conf.workers_bindid[ncuda + w] =
				(unsigned)(cores ? cores[w * cores_per_worker] : w * cores_per_worker);
	} else if (kcore == SL_KCORE_FORKJOIN) {
		/* Combined workers of exactly k cores running FORKJOIN tasks; starpu_init reads
		 * these variables. */
		char k[16];
		snprintf(k, sizeof k, "%d", cores_per_worker);
		if (setenv("STARPU_MIN_WORKERSIZE", k, 1) != 0 ||
		    setenv("STARPU_MAX_WORKERSIZE", k, 1) != 0)
			return -errno;
	}
	sl_codelets_setup(use_team || use_parallel_workers ? 1 : cores_per_worker, ncuda);

	if (!attach) {
		ret = sl_ooc_before_init();
		if (ret)
			return ret;
		/* Team workers: StarPU binds its workers by STARPU_WORKERS_CPUID before the
		 * conf's workers_bindid, and would put worker w on the list's w-th core, inside
		 * another worker's team. The cores given already hold that list, read as the
		 * groups' cores (runtime/starpu.py), so the variable is set aside during the start
		 * and put back. */
		char *listed = NULL;
		if (use_team && getenv("STARPU_WORKERS_CPUID")) {
			listed = strdup(getenv("STARPU_WORKERS_CPUID"));
			if (!listed || unsetenv("STARPU_WORKERS_CPUID")) {
				free(listed);
				return -ENOMEM;
			}
		}
		ret = comm ? sl_mpi_start(&conf, comm) : starpu_init(&conf);
		if (listed) {
			int put = setenv("STARPU_WORKERS_CPUID", listed, 1);
			free(listed);
			if (put && !ret) { /* the user's variable lost: stop, and say so */
				initialized = 1;
				sl_shutdown();
				return -ENOMEM;
			}
		}
		if (ret)
			return ret;
	}
	initialized = attach ? 2 : 1;
	ret = sl_ooc_after_init();
	if (ret) {
		sl_shutdown();
		return ret;
	}
#ifdef SL_HAVE_CUDA
	if (ncuda > 0) {
		/* every GPU asked for, or none: StarPU starts the ones it finds */
		if ((int)starpu_cuda_worker_get_count() != ncuda) {
			sl_shutdown();
			return -ENODEV;
		}
		/* a cuBLAS handle per CUDA worker, on its stream (it aborts on a failure: void) */
		starpu_cublas_init();
		cublas_on = 1;
		/* and its scratch, once, on its thread (none allocated in a task) */
		sl_codelets_cuda_workers(1);
	}
#endif

#if SL_HAVE_PARALLEL_WORKERS
	if (use_parallel_workers) {
		parallel_workers = sl_parallel_workers_init(nworkers);
		if (!parallel_workers) {
			sl_shutdown();
			return -ENODEV;
		}
	}
#endif
	sl_codelets_set_partition(kcore, nworkers, cores_per_worker, cores);
	return 0;
}

const char *sl_sched_policy_name(int i)
{
	struct starpu_sched_policy **policies = starpu_sched_get_predefined_policies();
	for (int k = 0; policies[k]; k++)
		if (k == i)
			return policies[k]->policy_name;
	return NULL;
}

int sl_start(const struct sl_partition *p, const int *cores, const void *comm)
{
	if (!p)
		return -EINVAL;
	sl_gpu_set_tf32(p->tf32);
	return start(p->workers, p->cores_per_worker, p->kcore, cores, p->ncuda, p->sched, comm, 0);
}

int sl_attach(const struct sl_partition *p, const int *cores)
{
	if (!p)
		return -EINVAL;
	return start(p->workers, p->cores_per_worker, p->kcore, cores, 0, NULL, NULL, 1);
}

#if SL_HAVE_PARALLEL_WORKERS
/* Waits for the tasks of every scheduling context. With the submitting thread's context
 * unset, starpu_task_wait_for_all() goes through all of them (the global one, the parallel
 * workers' own ones, the one enclosing them) instead of only the thread's. */
static int wait_every_context(void)
{
	unsigned ctx = starpu_sched_ctx_get_context();
	starpu_sched_ctx_set_context(NULL);
	int ret = starpu_task_wait_for_all();
	if (ctx != STARPU_NMAX_SCHED_CTXS)
		starpu_sched_ctx_set_context(&ctx);
	return ret;
}
#endif

/* Returns once every task submitted so far has completed (collective under StarPU-MPI: on
 * every rank, with its MPI requests). Parallel workers need more than
 * starpu_task_wait_for_all(): our tasks go to the context enclosing the parallel workers, and
 * a parallel worker's master moves each task it pops from there into its own context, where
 * the task then queues and runs. StarPU 1.4's wait goes through the nested contexts first and
 * the enclosing one last, so it returns as soon as the last task has been moved, often before
 * it has run (seen here: one task still pending after every wait of a training step).
 * Freeing the task arguments then let that task, the last AdamW update, read freed memory:
 * wrong, varying losses and NaN. So, on this process alone first: the enclosing context, after
 * which no task moves any more, then every context, until StarPU counts no unfinished task;
 * then the usual wait, once (the MPI one is collective), for MPI requests still in flight. */
static int wait_tasks(int collective)
{
#if SL_HAVE_PARALLEL_WORKERS
	if (parallel_workers) {
		do {
			int ret = starpu_task_wait_for_all();
			if (ret == 0)
				ret = wait_every_context();
			if (ret != 0)
				return ret;
		} while (starpu_task_nsubmitted() > 0);
	}
#endif
	return collective ? sl_mpi_wait_all() : starpu_task_wait_for_all();
}

int sl_shutdown(void)
{
	if (!initialized)
		return 0;
	int ret = wait_tasks(0); /* its error returned once StarPU is stopped */
	sl_args_free_completed();
#if SL_HAVE_PARALLEL_WORKERS
	if (parallel_workers) {
		sl_parallel_workers_shutdown(parallel_workers);
		parallel_workers = NULL;
	}
#endif
	sl_codelets_set_partition(SL_KCORE_SINGLE, 0, 1, NULL);
#ifdef SL_HAVE_CUDA
	if (cublas_on) {
		sl_codelets_cuda_workers(0);
		starpu_cublas_shutdown();
		cublas_on = 0;
	}
#endif
	if (initialized == 1) { /* attached (2): the starter shuts StarPU down */
		int mpi = sl_mpi_stop();
		if (mpi == 1)
			starpu_shutdown();
		else if (ret == 0)
			ret = mpi;
	}
	sl_ooc_after_shutdown();
	initialized = 0;
	return ret;
}

int sl_wait_all(void)
{
	int ret = wait_tasks(sl_mpi_size() > 1);
	if (ret == 0)
		sl_args_free_completed();
	return ret;
}

void sl_pause(void) { starpu_pause(); }

void sl_resume(void) { starpu_resume(); }

int sl_worker_count(void) { return (int)starpu_worker_get_count(); }

int sl_cpu_worker_count(void) { return (int)starpu_cpu_worker_get_count(); }

int sl_cuda_worker_count(void) { return (int)starpu_cuda_worker_get_count(); }

#ifdef SL_HAVE_HWLOC
/* The topology as StarPU loads it (topology.c: this system, the allowed PUs), so that the
 * logical indexes and the PU count are StarPU's. starpu_get_hwloc_topology() would give
 * StarPU's own, but only once StarPU runs, and these are asked before it starts. 0, or
 * -ENOMEM / -ENODEV with nothing to destroy. */
static int load_topology(hwloc_topology_t *topo)
{
	if (hwloc_topology_init(topo))
		return -ENOMEM;
	if (hwloc_topology_set_flags(*topo, HWLOC_TOPOLOGY_FLAG_IS_THISSYSTEM) ||
	    hwloc_topology_load(*topo)) {
		hwloc_topology_destroy(*topo);
		return -ENODEV;
	}
	return 0;
}
#endif

int sl_cpu_indexes(const int *in, int *out, int n, int to_logical)
{
	for (int i = 0; i < n; i++)
		out[i] = in[i];
#ifdef SL_HAVE_HWLOC
	hwloc_topology_t topo;
	int ret = load_topology(&topo);
	if (ret)
		return ret;
	for (int i = 0; i < n && !ret; i++) {
		hwloc_obj_t pu = to_logical ?
			hwloc_get_pu_obj_by_os_index(topo, (unsigned)in[i]) :
			hwloc_get_obj_by_type(topo, HWLOC_OBJ_PU, (unsigned)in[i]);
		if (!pu)
			ret = -EINVAL;
		else
			out[i] = (int)(to_logical ? pu->logical_index : pu->os_index);
	}
	hwloc_topology_destroy(topo);
	return ret;
#else
	(void)to_logical;
	return -ENOSYS;
#endif
}

int sl_cpu_count(void)
{
#ifdef SL_HAVE_HWLOC
	hwloc_topology_t topo;
	int ret = load_topology(&topo);
	if (ret)
		return ret;
	int n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
	hwloc_topology_destroy(topo);
	return n > 0 ? n : -ENODEV;
#else
	return -ENOSYS;
#endif
}

int sl_cpu_worker_cores(int *cores, int max)
{
	int ids[STARPU_NMAXWORKERS];
	int nw = starpu_worker_get_ids_by_type(STARPU_CPU_WORKER, ids, STARPU_NMAXWORKERS);
	for (int w = 0; w < nw && w < max; w++)
		cores[w] = starpu_worker_get_bindid(ids[w]);
	return nw;
}

int sl_cuda_worker_devices(int *devs, int max)
{
	int ids[STARPU_NMAXWORKERS];
	int nw = starpu_worker_get_ids_by_type(STARPU_CUDA_WORKER, ids, STARPU_NMAXWORKERS);
	int n = 0, seen[STARPU_NMAXWORKERS];
	for (int w = 0; w < nw; w++) {
		/* several workers may drive one device (STARPU_NWORKER_PER_CUDA): count it once */
		int d = starpu_worker_get_devid(ids[w]), k = 0;
		while (k < n && seen[k] != d)
			k++;
		if (k < n)
			continue;
		if (n < max)
			devs[n] = d;
		seen[n++] = d;
	}
	return n;
}

int sl_gpu_memory_used(size_t *used)
{
#ifdef SL_HAVE_CUDA
	/* the primary context of each CUDA worker's device, the one the worker uses (its device
	 * id from StarPU: STARPU_WORKERS_CUDAID or CUDA_VISIBLE_DEVICES may name others than
	 * 0..n-1); the calling thread's current device put back after (its direct runs' stream
	 * is on it), and a failure's error taken off the thread (else its next launch check
	 * reports it) */
	int devs[STARPU_NMAXWORKERS];
	int ndev = sl_cuda_worker_devices(devs, STARPU_NMAXWORKERS);
	int cur, ret = 0;
	size_t sum = 0;
	if (ndev < 1)
		return -ENODEV;
	if (cudaGetDevice(&cur) != cudaSuccess) {
		(void)cudaGetLastError();
		return -EIO;
	}
	for (int i = 0; i < ndev && !ret; i++) {
		size_t free_b, total_b;
		if (cudaSetDevice(devs[i]) != cudaSuccess ||
		    cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
			ret = -EIO;
		else
			sum += total_b - free_b;
	}
	if (cudaSetDevice(cur) != cudaSuccess)
		ret = -EIO;
	if (ret) {
		(void)cudaGetLastError();
		return ret;
	}
	*used = sum;
	return 0;
#else
	(void)used;
	return -ENODEV;
#endif
}

int sl_have_cuda(void)
{
#ifdef SL_HAVE_CUDA
	return 1;
#else
	return 0;
#endif
}

int sl_max_cpus(void) { return STARPU_MAXCPUS; }

int sl_have_parallel_workers(void) { return SL_HAVE_PARALLEL_WORKERS; }

/* The mark tools/patches/starpu-1.4.12-ws-no-self-steal.patch leaves in libstarpu, weak:
 * NULL where the library loaded lacks it (its lws/ws can deadlock after parallel workers,
 * docs/clusters.md), whatever the headers this was built with. */
extern const int starpu_llm_fix_ws_no_self_steal __attribute__((weak));

int sl_starpu_ws_fixed(void) { return &starpu_llm_fix_ws_no_self_steal != NULL; }

const char *sl_starpu_library(void)
{
	Dl_info info;
	return dladdr((void *)starpu_init, &info) && info.dli_fname ? info.dli_fname : "";
}

void sl_starpu_version(int *major, int *minor, int *release)
{
	starpu_get_version(major, minor, release);
}

sl_handle sl_register_vector(void *ptr, size_t n, size_t elemsize)
{
	starpu_data_handle_t h = NULL;
	if (ptr)
		starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t)ptr, n, elemsize);
	else
		starpu_vector_data_register(&h, -1, 0, n, elemsize);
	return h;
}

void sl_unregister(sl_handle h) { starpu_data_unregister(h); }

void sl_invalidate(sl_handle h) { starpu_data_invalidate_submit(h); }

void *sl_acquire(sl_handle h, int mode)
{
	enum starpu_data_access_mode m = mode == 3 ? STARPU_RW : mode == 2 ? STARPU_W : STARPU_R;
	if (starpu_data_acquire(h, m) != 0)
		return NULL;
	return starpu_data_get_local_ptr(h);
}

void sl_release(sl_handle h) { starpu_data_release(h); }

void *sl_home_ptr(sl_handle h) { return starpu_data_handle_to_pointer(h, STARPU_MAIN_RAM); }

/* StarPU 1.4.12 keeps the operations of the data interfaces registered at run time (starpupy
 * registers 3 at each starpu.init()) in a table indexed by id - STARPU_MAX_INTERFACE_ID that
 * it frees at shutdown (size 0), while the ids keep growing from one init to the next; and
 * the table grows at most once per registration, to 16 entries the first time. From the 7th
 * starpu.init() of a process, starpupy's first interface goes past the 16 entries (heap
 * corruption, then a crash). Here the table is grown in steps, each within its bounds, to
 * hold the next n ids: called before starpu.init() (its size is then 0). */
#if STARPU_MAJOR_VERSION > 1 || STARPU_MINOR_VERSION >= 4
static struct starpu_data_interface_ops reserved_ops = { .name = "sl_reserved" };

void sl_reserve_interface_ids(int n)
{
	int next = starpu_data_interface_get_next_id();
	unsigned need = (unsigned)(next - STARPU_MAX_INTERFACE_ID + (n > 0 ? n : 0));
	for (unsigned size = 0; size <= need; size = size ? 2 * size : 16) {
		/* an id above the size grows the table (to 16, then doubling); its entry,
		 * id - STARPU_MAX_INTERFACE_ID, stays below the new size */
		unsigned id =
			size + 1 < STARPU_MAX_INTERFACE_ID ? STARPU_MAX_INTERFACE_ID : size + 1;
		reserved_ops.interfaceid = (enum starpu_data_interface_id)id;
		starpu_data_register_ops(&reserved_ops);
	}
}
#else
void sl_reserve_interface_ids(int n) { (void)n; } /* no starpupy before 1.4 */
#endif
