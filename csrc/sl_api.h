/* The C API of starpu_llm seen by Python (the cffi module is generated from this file and
 * kernels.h). Non-variadic on purpose: one small helper per StarPU call or task type.
 * Every int-returning function returns 0 on success and a negative errno-style code on
 * failure (the Python side turns it into an exception naming the call). */
#ifndef SL_API_H
#define SL_API_H
#include <stddef.h>
#include <stdint.h>

typedef struct _starpu_data_state *sl_handle; /* == starpu_data_handle_t */

/* ---- runtime (runtime.c) ---- */
/* Starts StarPU (StarPU-MPI when comm is not NULL: the address of an MPI_Comm, e.g.
 * mpi4py's MPI._addressof(comm); MPI must already run with at least MPI_THREAD_SERIALIZED)
 * on ncpus cores, the partition ncpus/k workers x k cores. cores lists the ncpus logical core
 * ids, group by group (NULL: 0..ncpus-1). sched NULL or "" keeps StarPU's choice.
 * How a task gets k > 1 cores:
 *   - parallel workers / clusters, where the StarPU build has them;
 *   - else kcore SL_KCORE_TEAM: one StarPU worker per group of k cores, running sequential
 *     tasks with an OpenMP team bound to its group (what StarPU 1.4's parallel workers do);
 *   - else (SL_KCORE_FORKJOIN) FORKJOIN parallel tasks on combined workers of k cores. */
#define SL_KCORE_FORKJOIN 0
#define SL_KCORE_TEAM	  1
#define SL_MAX_GROUP	  64 /* most cores of one team worker */
int sl_start(int ncpus, int cores_per_task, int kcore, const int *cores, const char *sched,
	     const void *comm);
/* The same set-up after init as sl_start, on a StarPU that another starter (starpupy's
 * starpu.init(), starpu_llm/runtime/starpupy_face.py) has already initialised with the partition's
 * configuration; sl_shutdown then leaves starpu_shutdown to that starter. No StarPU-MPI. */
int sl_attach(int ncpus, int cores_per_task, int kcore, const int *cores);
/* Before starpu.init(): room in StarPU's table of data interfaces for the next n interface
 * ids (works around a StarPU 1.4.12 overflow from the 7th starpupy init in a process). */
void sl_reserve_interface_ids(int n);
int sl_shutdown(void);
int sl_wait_all(void);
void sl_pause(void);
void sl_resume(void);
int sl_worker_count(void);
/* Tasks submitted from now on run on StarPU worker `worker` (-1: wherever the scheduler
 * puts them). Used to keep each data-parallel sub-batch on one worker. */
void sl_set_exec_worker(int worker);
int sl_max_cpus(void);		    /* STARPU_MAXCPUS of the StarPU build */
int sl_have_parallel_workers(void); /* 1.4 parallel workers / 1.3 clusters compiled in */
void sl_starpu_version(int *major, int *minor, int *release);

/* ---- StarPU-MPI (mpi.c; stubs returning -ENOSYS when built without MPI) ---- */
int sl_mpi_available(void);
int sl_mpi_rank(void);
int sl_mpi_size(void);
/* Every process registers every handle with the same dense tag and the owning rank. */
int sl_mpi_register(sl_handle h, int64_t tag, int owner);
/* The rank that runs the tasks submitted next. */
void sl_mpi_set_exec_node(int rank);
/* Sum the STARPU_REDUX contributions of all ranks into the owner's copy (a binary tree where
 * StarPU has one, 1.4; flat to the owner on 1.3). */
int sl_mpi_redux(sl_handle h);
int sl_mpi_wait_all(void);
int sl_mpi_tag_ub(void);

/* ---- data (runtime.c) ---- */
/* A vector of n elements of elemsize bytes on memory at ptr (ptr NULL lets StarPU allocate
 * it lazily; not used with FORKJOIN tasks: StarPU 1.3.10's peager crashes on such buffers). */
sl_handle sl_register_vector(void *ptr, size_t n, size_t elemsize);
/* Split a vector into nparts equal blocks (StarPU data partitioning); children out. */
int sl_partition(sl_handle h, int nparts, sl_handle *children);
int sl_unpartition(sl_handle h);
void sl_unregister(sl_handle h);
/* Make gradient handle h accept STARPU_REDUX contributions (zero init, add reduction). */
int sl_set_grad_reduction(sl_handle h);
/* Acquire for reading (mode 1) or read-write (3); returns the local pointer or NULL. */
void *sl_acquire(sl_handle h, int mode);
void sl_release(sl_handle h);

/* ---- task submission (one helper per codelet, csrc/codelets/<layer>.c) ----
 * `redux` = 1 when a parameter gradient is a reduction target shared by sub-batches. */
/* tokens at positions pos..pos+T-1 (pos 0 in training, the next positions in generation) */
int sl_submit_encoder_forward(sl_handle out, sl_handle inp, sl_handle wte, sl_handle wpe, int B,
			      int T, int C, int pos);
int sl_submit_encoder_backward(sl_handle dwte, sl_handle dwpe, sl_handle dout, sl_handle inp, int B,
			       int T, int C, int redux);
int sl_submit_layernorm_forward(sl_handle out, sl_handle mean, sl_handle rstd, sl_handle inp,
				sl_handle weight, sl_handle bias, int N, int C);
int sl_submit_layernorm_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias, sl_handle dout,
				 sl_handle inp, sl_handle weight, sl_handle mean, sl_handle rstd,
				 int N, int C, int accumulate, int redux);
/* bias / dbias may be NULL (the tied lm head has none) */
int sl_submit_matmul_forward(sl_handle out, sl_handle inp, sl_handle weight, sl_handle bias, int N,
			     int C, int OC);
int sl_submit_matmul_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias, sl_handle dout,
			      sl_handle inp, sl_handle weight, int N, int C, int OC, int redux);
int sl_submit_attention_forward(sl_handle out, sl_handle preatt, sl_handle att, sl_handle qkv,
				int B, int T, int C, int NH);
/* scratch: 2*B*NH*T*T floats (dpreatt, datt), overwritten by each task */
int sl_submit_attention_backward(sl_handle dqkv, sl_handle scratch, sl_handle dout, sl_handle qkv,
				 sl_handle att, int B, int T, int C, int NH);
/* generation's key/value cache, kcache and vcache (B,NH,maxT,hs) per layer (kernels.h) */
int sl_submit_kv_append(sl_handle kcache, sl_handle vcache, sl_handle qkv, int B, int Tn, int C,
			int NH, int maxT, int pos);
int sl_submit_attention_decode(sl_handle out, sl_handle qkv, sl_handle kcache, sl_handle vcache,
			       int B, int Tn, int C, int NH, int maxT, int pos);
int sl_submit_gelu_forward(sl_handle out, sl_handle inp, size_t N);
int sl_submit_gelu_backward(sl_handle dinp, sl_handle inp, sl_handle dout, size_t N);
int sl_submit_residual_forward(sl_handle out, sl_handle inp1, sl_handle inp2, size_t N);
int sl_submit_crossentropy_forward(sl_handle probs, sl_handle losses, sl_handle logits,
				   sl_handle targets, int N, int V, int Vp);
int sl_submit_crossentropy_backward(sl_handle dlogits, sl_handle probs, sl_handle targets, int N,
				    int V, int Vp, float dloss);
/* sumsq: NULL (no clipping, max_norm 0), or the squared global gradient norm (1 double, the
 * root of the norm_sum tree) by which the task clips the gradient to max_norm > 0 */
int sl_submit_adamw(sl_handle params, sl_handle grads, sl_handle m, sl_handle v, sl_handle sumsq,
		    float max_norm, float lr, float beta1, float beta2, float eps,
		    float weight_decay, int t);
/* sumsq (1 double) = sum of squares of grad (gradient clipping, csrc/codelets/gradnorm.c) */
int sl_submit_grad_sumsq(sl_handle sumsq, sl_handle grad);
/* out (1 double) = in[0] + ... + in[n-1] (1 double each), 1 <= n <= 7 */
int sl_submit_norm_sum(sl_handle out, const sl_handle *in, int n);
/* inputs/targets (n int32) from tokens[pos .. pos+n] (the caller keeps tokens alive) */
int sl_submit_load_batch(sl_handle inputs, sl_handle targets, const uint16_t *tokens, size_t pos,
			 size_t n);

/* A task reading the n vector handles src and copying them, one after the other, into the
 * dst_bytes at dst_ptr (their total size), the memory of handle dst (any interface, e.g. a
 * starpupy handle), which the task writes (STARPU_W): the starpupy face's checkpoint snapshot. */
int sl_submit_gather(sl_handle dst, void *dst_ptr, size_t dst_bytes, const sl_handle *src, int n);

/* ---- declared access modes (csrc/codelets/registry.c) ----
 * Each codelet declares the access mode of each of its buffers once (SL_CODELET in
 * csrc/codelets/codelet.h); the submit helpers above build their tasks from that table.
 * sl_codelet_modes fills modes[i] (i < max) with the SL_ACCESS_* bits of buffer i of a task
 * of codelet (an index of sl_codelet_name) submitted with this redux / accumulate, plus
 * SL_ACCESS_OPTIONAL on a last buffer a task may leave out (matmul's bias), and returns the
 * buffer count (-EINVAL for no such codelet). */
#define SL_ACCESS_OPTIONAL 8
int sl_codelet_modes(int codelet, int redux, int accumulate, int32_t *modes, int max);

/* ---- diagnostics ---- */
/* A task that records, for each thread of its team: the thread count, and the CPU mask
 * (bit i = core i, first 64 cores) each thread runs on. out has room for 1 + max_threads. */
int sl_submit_probe(uint64_t *out, int max_threads);

/* Task trace: when enabled, each task records its codelet, worker and start/end time
 * (CLOCK_MONOTONIC ns, the clock of Python's time.monotonic_ns()), and the data handles and
 * access modes StarPU gave it (read back from the running task, not from our own tables).
 * A reduction method StarPU runs inline inside another task records nbuffers = -1. */
#define SL_TRACE_MAXBUF 8 /* buffers recorded per task (STARPU_NMAXBUFS of Debian's 1.3) */
#define SL_ACCESS_R	1 /* normalised access modes: reads, */
#define SL_ACCESS_W	2 /* writes (W, RW, SCRATCH), */
#define SL_ACCESS_REDUX 4 /* or contributes to a reduction (STARPU_REDUX) */
struct sl_trace_event {
	int32_t codelet;  /* index into sl_codelet_name() */
	int32_t worker;	  /* StarPU worker id of the task's master thread */
	int32_t ncores;	  /* cores of the (combined) worker */
	int32_t nbuffers; /* buffers of the task (only the first SL_TRACE_MAXBUF kept) */
	int64_t start_ns;
	int64_t end_ns;
	int32_t modes[SL_TRACE_MAXBUF]; /* SL_ACCESS_* bits */
	sl_handle handles[SL_TRACE_MAXBUF];
	double flops;	/* the flop count the task was submitted with */
	uint64_t job;	/* the task's submission number (sl_insert_task) */
};
int sl_trace_enable(size_t capacity); /* capacity 0 disables and frees */
/* Dry run (on = 1): every task still runs through StarPU, with its dependencies, placement and
 * trace, but its kernel is skipped; the task graph of a step is then recorded in a fraction of
 * its run time (starpu_llm/perf/graph.py). The data are left as they were. */
void sl_set_dry_run(int on);
int sl_dry_run(void);
size_t sl_trace_count(void);	      /* events recorded (capped at capacity) */
const struct sl_trace_event *sl_trace_events(void);
const char *sl_codelet_name(int codelet);
int sl_codelet_count(void);
int sl_codelet_sequential(int codelet); /* 1: always on one core; -1: no such codelet */

#endif
