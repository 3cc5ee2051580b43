/* The C API of starpu_llm's StarPU layer seen by Python (the _clib cffi module is generated from
 * this file, csrc/codelets/sl_codelets.h and csrc/kernels/kernels.h). Non-variadic on purpose.
 * Every int-returning function returns 0 on success and a negative errno-style code on
 * failure (the Python side turns it into an exception naming the call). */
#ifndef SL_API_H
#define SL_API_H
#include <stddef.h>
#include <stdint.h>

typedef struct _starpu_data_state *sl_handle; /* == starpu_data_handle_t */

/* ---- runtime (runtime.c) ---- */
/* A partition as Python resolved it (starpu_llm/plan/partition.py's record.Partition), everything
 * sl_start needs of it: the flags --workers, --cores-per-worker, --kcore, --gpus,
 * --gpu-matmul and --sched arrive here, in one call. */
struct sl_partition {
	int workers;	      /* N */
	int cores_per_worker; /* K */
	int kcore;	      /* SL_KCORE_*: what gives a task its K cores */
	int ncuda;	      /* CUDA workers, GPUs 0..ncuda-1 */
	int tf32;	      /* their matmuls in TF32 (1) or fp32 (0) */
	const char *sched;    /* the StarPU scheduler; NULL or "": StarPU's choice */
};
/* Starts StarPU (StarPU-MPI when comm is not NULL: the address of an MPI_Comm, e.g.
 * mpi4py's MPI._addressof(comm); MPI must already run with at least MPI_THREAD_SERIALIZED)
 * for the partition p: workers x cores_per_worker cores, with the mechanism that gives
 * a task its cores, and ncuda CUDA workers (GPUs 0..ncuda-1, and no other accelerator;
 * -ENODEV when this is no CUDA build (sl_have_cuda) or StarPU finds fewer GPUs). Python
 * decides the partition (starpu_llm/plan/partition.py); this starts it and decides nothing (-EINVAL
 * for a mechanism it cannot run). cores lists the workers x cores_per_worker logical core ids,
 * group by group, then one core for each CUDA worker's thread (NULL: 0..). The mechanisms
 * (cores_per_worker > 1):
 *   - SL_KCORE_PARALLEL: StarPU parallel workers (1.4) / clusters (1.3), where the build has
 *     them (sl_have_parallel_workers), on distinct cores, no memory limit, no GPUs;
 *   - SL_KCORE_TEAM: one StarPU worker per group of cores, running sequential tasks with an
 *     OpenMP team bound to its group (what StarPU 1.4's parallel workers do);
 *   - SL_KCORE_FORKJOIN: FORKJOIN parallel tasks on combined workers of that size;
 *   - SL_KCORE_SINGLE: one core per worker (cores_per_worker 1).
 * With GPUs, the tasks of every codelet with a CUDA body (SL_CUDA) may run on a CPU worker or
 * a CUDA worker: the scheduler decides (dmda/dmdas by the codelets' history perf models),
 * and StarPU moves the data; a cuBLAS handle is made on each CUDA worker. */
#define SL_KCORE_FORKJOIN 0
#define SL_KCORE_TEAM	  1
#define SL_KCORE_PARALLEL 2
#define SL_KCORE_SINGLE	  3
#define SL_MAX_GROUP	  64 /* most cores of one team worker */
int sl_start(const struct sl_partition *p, const int *cores, const void *comm);
/* Where the tasks of a codelet may run (SL_ON_* bits) on a start with ncuda CUDA workers: the
 * one decision, which sl_start applies (also on a build without CUDA, where ncuda > 0 cannot
 * start: what a CUDA build would do). Without GPUs on the CPU workers; with GPUs, every codelet
 * with a CUDA body on the GPUs only (no CPU function: dmda/dmdas never run a layer task on a
 * CPU to calibrate it, nor move its data across the bus for that), the CPU workers keeping the
 * codelets without one (the batch loads, which read the token shard in host memory). 0: no
 * such codelet. */
#define SL_ON_CPU  1
#define SL_ON_CUDA 2
int sl_codelet_where(int codelet, int ncuda);
/* Where the tasks of a codelet may run as StarPU was started (SL_ON_* bits of its CPU and
 * CUDA functions; 0 before the first start). */
int sl_codelet_placed(int codelet);
/* The same set-up after init as sl_start, on a StarPU that another starter (starpupy's
 * starpu.init(), starpu_llm/runtime/starpupy_face.py) has already initialised with the partition's
 * configuration; sl_shutdown then leaves starpu_shutdown to that starter. No StarPU-MPI. */
int sl_attach(const struct sl_partition *p, const int *cores);
/* Before starpu.init(): room in StarPU's table of data interfaces for the next n interface
 * ids (works around a StarPU 1.4.12 overflow from the 7th starpupy init in a process). */
void sl_reserve_interface_ids(int n);
/* Waits for the tasks, then stops StarPU (and StarPU-MPI) whatever the wait returned: 0, or
 * the first error of the wait or of starpu_mpi_shutdown. */
int sl_shutdown(void);
int sl_wait_all(void);
void sl_pause(void);
void sl_resume(void);
int sl_worker_count(void);	    /* every StarPU worker: CPU and CUDA */
int sl_cpu_worker_count(void);
int sl_cuda_worker_count(void);
/* The core StarPU bound each CPU worker's thread to (starpu_worker_get_bindid), in worker
 * order, the first `max` into cores; returns how many CPU workers there are. */
int sl_cpu_worker_cores(int *cores, int max);
/* StarPU names a CPU by hwloc's logical index (STARPU_WORKERS_CPUID, the workers' binding,
 * sl_cpu_worker_cores), the OS by its own (sched_getaffinity); they differ where a core's
 * hyperthreads are not numbered together. Converts n indexes from the OS's to the logical
 * ones (to_logical) or back into out; 0, -EINVAL for an index no allowed PU has, -ENOSYS
 * without hwloc (out = in: StarPU then numbers as the OS does). */
int sl_cpu_indexes(const int *in, int *out, int n, int to_logical);
/* How many CPUs StarPU numbers (0 to n - 1): the PUs of the topology it loads, those of this
 * process's cpuset (fewer than the host's in a container or a Slurm job); -ENOSYS without hwloc
 * (StarPU then numbers the OS's CPUs), -ENOMEM / -ENODEV where the topology cannot be loaded. */
int sl_cpu_count(void);
/* The CUDA devices StarPU's CUDA workers run on (starpu_worker_get_devid: what
 * STARPU_WORKERS_CUDAID and CUDA_VISIBLE_DEVICES made of them), each once, in worker order,
 * the first `max` into devs; returns how many there are (0 without CUDA workers). */
int sl_cuda_worker_devices(int *devs, int max);
/* The memory in use on those devices (cudaMemGetInfo: total - free, StarPU's buffers and
 * caches, the CUDA contexts, and any other process's on the same GPUs) into *used; -ENODEV on a
 * build without CUDA or a run without CUDA workers, -EIO when CUDA fails. */
int sl_gpu_memory_used(size_t *used);
int sl_have_cuda(void);		    /* 1 in a CUDA build (StarPU with CUDA, the GPU kernels) */
int sl_max_cpus(void);		    /* STARPU_MAXCPUS of the StarPU build */
/* The name of the i-th scheduling policy this StarPU build has, NULL past the last (callable
 * before sl_start: a --sched that names none of them is refused before StarPU starts). */
const char *sl_sched_policy_name(int i);
int sl_have_parallel_workers(void); /* 1.4 parallel workers / 1.3 clusters compiled in */
/* 1 where the libstarpu loaded carries tools/patches/starpu-1.4.12-ws-no-self-steal.patch (its
 * mark), 0 otherwise: parallel workers are used only then (runtime/starpu.py
 * parallel_workers_here) */
int sl_starpu_ws_fixed(void);
const char *sl_starpu_library(void); /* the file of the libstarpu loaded ("" if unknown) */
void sl_starpu_version(int *major, int *minor, int *release);

/* ---- out of core (ooc.c) ----
 * Before sl_start: cap the main memory StarPU allocates at `bytes` (0: no cap, the default)
 * and give it a disk memory node in the folder `dir` (which must exist and hold nothing else:
 * StarPU's files are created and removed there) to evict the data it allocated itself (handles
 * registered without memory) when the cap is reached. Returns -EALREADY while StarPU runs. */
int sl_set_memory_limit(size_t bytes, const char *dir);
/* The disk memory node of a running StarPU with a memory limit, or -1. */
int sl_ooc_disk_node(void);
/* Bytes StarPU has read from and written to the disk node since the start. */
void sl_ooc_traffic(uint64_t *read, uint64_t *written);
/* Bytes of main memory StarPU has allocated (counted against the cap) now. */
size_t sl_memory_used(void);

/* ---- StarPU-MPI (mpi.c; stubs returning -ENOSYS when built without MPI) ---- */
int sl_mpi_available(void);
int sl_mpi_rank(void);
int sl_mpi_size(void);
/* Every process registers every handle with the same dense tag and the owning rank. */
int sl_mpi_register(sl_handle h, int64_t tag, int owner);
int sl_mpi_wait_all(void);
int64_t sl_mpi_tag_ub(void); /* the largest data tag StarPU-MPI takes */
/* Bring h's current value to rank `node` (its owner sends it; a no-op where node owns it);
 * detached: a later acquire on node waits for it. Every rank calls it. */
int sl_mpi_fetch(sl_handle h, int node);
/* StarPU-MPI's own count of the bytes this rank has sent to each rank (sent[r], r < size)
 * since it started: 0, or -ENODATA when its statistics are off (STARPU_COMM_STATS=1 on
 * StarPU 1.3, STARPU_MPI_STATS=1 on 1.4, set before the start). */
int sl_mpi_bytes_sent(size_t *sent);
/* How StarPU-MPI's progression thread waits (mpi_poll.c): max_us 0 spins (StarPU's own way),
 * max_us > 0 sleeps between polls that find nothing, at most max_us each (-EINVAL below 0,
 * -ENOSYS without MPI, -ENOTSUP when StarPU-MPI does not call this module's MPI_Test:
 * MPI's library was made global before the module was loaded). Its polls, sleeps and time slept (ns) so far, counted with backoff on. */
int sl_mpi_poll_backoff(int max_us);
void sl_mpi_poll_stats(long long *polls, long long *sleeps, long long *slept_ns);
/* The backoff's decision (mpi_poll.c), a pure function for tests: after a poll that ended
 * elapsed_ns after the previous one ended (news: it completed a request or moved data), the
 * ns to sleep (0: poll again), at most max_ns; st starts from sl_mpi_poll_reset. */
struct sl_poll_state { long quiet_ns, spin_ns, backoff_ns; };
void sl_mpi_poll_reset(struct sl_poll_state *st);
long sl_mpi_poll_next(struct sl_poll_state *st, int news, long elapsed_ns, long max_ns);

/* ---- data (runtime.c) ---- */
/* A vector of n elements of elemsize bytes on memory at ptr (ptr NULL lets StarPU allocate
 * it lazily; not used with FORKJOIN tasks: StarPU 1.3.10's peager crashes on such buffers). */
sl_handle sl_register_vector(void *ptr, size_t n, size_t elemsize);
void sl_unregister(sl_handle h);
/* Once the tasks submitted so far that use h have run, drop its values (StarPU frees its
 * copies, writes none back): the next task must write it (STARPU_W) before any reads it. */
void sl_invalidate(sl_handle h);
/* Make gradient handle h accept STARPU_REDUX contributions (zero init, add reduction). */
int sl_set_grad_reduction(sl_handle h);
/* Acquire for reading (mode 1), writing (2: the old values are not needed, as for a handle
 * that has none yet) or read-write (3); returns the local pointer or NULL. */
void *sl_acquire(sl_handle h, int mode);
void sl_release(sl_handle h);
/* Where h's values live in main memory (the memory it was registered on, or StarPU's copy),
 * NULL when it has none there; for tests, which check where received data lands. */
void *sl_home_ptr(sl_handle h);

/* ---- task submission (submit.c): the one insert path of every task ----
 * A task of codelet (an index of the codelet table, sl_codelets.h) on the n handles given in
 * declared order (a shorter list leaves out trailing optional buffers; a repeated last buffer
 * comes any number of times), with the modes its declaration gives for this redux (parameter
 * gradients as STARPU_REDUX contributions) and for the accumulate field of args the
 * declaration names (SL_CODELET_ACC), a copy of args (args_size bytes, the codelet's argument
 * struct) and its flop count from the declaration. Where it runs is
 * the caller's decision, given with every task (starpu_llm/plan/sites.py decides):
 *   node:   the StarPU-MPI rank that runs it, or SL_NODE_OWNER: the owner of the data it
 *           writes (StarPU-MPI's rule); ignored by plain StarPU;
 *   worker: the StarPU worker that runs it, or SL_ANY_WORKER: where the scheduler puts it;
 *   priority: the task's StarPU priority (0: the default; higher runs first among the tasks
 *           ready on a worker: lws pops its queue highest priority first, 1.3 and 1.4 alike;
 *           StarPU-MPI also gives it to the task's transfers). A pipeline's (1F1B). */
#define SL_NODE_OWNER -1
#define SL_ANY_WORKER -1
int sl_submit(int codelet, const sl_handle *handles, int n, int redux, const void *args,
	      size_t args_size, int node, int worker, int priority);
/* How many tasks sl_submit has submitted in this process: the next one's submission number
 * (its trace's job; perf/graph.py matches a recorded task with its site by it). */
long long sl_submitted(void);

/* ---- task trace (trace.c) ----
 * When enabled, each task records its codelet, worker and start/end time (CLOCK_MONOTONIC ns,
 * the clock of Python's time.monotonic_ns()), and the data handles and access modes StarPU
 * gave it (read back from the running task, not from our own tables). A reduction method
 * StarPU runs inline inside another task records nbuffers = -1. Modes: SL_ACCESS_* bits. */
struct sl_trace_event {
	int32_t codelet;  /* index into the codelet table */
	int32_t worker;	  /* StarPU worker id of the task's master thread */
	int32_t ncores;	  /* cores of the (combined) worker */
	int32_t nbuffers; /* buffers of the task */
	int64_t start_ns;
	int64_t end_ns;
	int32_t *modes;	    /* nbuffers SL_ACCESS_* bits (freed with the trace) */
	sl_handle *handles; /* nbuffers handles */
	double flops;	/* the flop count the task was submitted with */
	int64_t nbytes;	/* the sum of its buffers' sizes (starpu_data_get_size) */
	uint64_t job;	/* the task's submission number (sl_submit) */
	int32_t priority; /* the task's priority (sl_submit) */
	/* a CUDA task's kernels on the GPU (CLOCK_MONOTONIC, as start_ns): from before its first
	 * to after its last, in its stream; 0 for a CPU task, or until sl_trace_gpu_times */
	int64_t gpu_start_ns;
	int64_t gpu_end_ns;
	void *gpu_events[2]; /* their CUDA events until then */
	int32_t gpu_device;
};
int sl_trace_enable(size_t capacity); /* capacity 0 disables and frees */
/* Dry run (on = 1): every task still runs through StarPU, with its dependencies, placement and
 * trace, but its body is skipped; the task graph of a step is then recorded in a fraction of
 * its run time (starpu_llm/perf/graph.py). The data are left as they were. */
void sl_set_dry_run(int on);
int sl_dry_run(void);
size_t sl_trace_count(void); /* events recorded (capped at capacity) */
/* Fills the GPU times of the events recorded so far whose tasks have ended (waiting for their
 * kernels); returns how many were timed (0 in a build without CUDA). */
int sl_trace_gpu_times(void);
const struct sl_trace_event *sl_trace_events(void);

#endif
