/* A StarPU codelet for every codelet of the table (csrc/codelets/): its CPU function and, in a
 * CUDA build running GPUs, its CUDA function beside it (asynchronous, on the worker's stream),
 * its history perf model "sl_<name>" (one history per kind of worker: StarPU's dmda/dmdas
 * choose between a CPU and a GPU by it), its access modes when they are fixed, and the cores
 * it runs on; and the one CPU entry and the one CUDA entry of every task (team size or GPU
 * stream, trace, dry run, the body). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#ifdef SL_HAVE_CUDA
#include <starpu_cublas_v2.h>
#endif

static struct starpu_codelet cls[SL_MAX_CODELETS];
static struct starpu_perfmodel models[SL_MAX_CODELETS];
static char symbols[SL_MAX_CODELETS][64];
static int built;
/* Whether this start's CUDA workers run their matmuls in fp32 (--gpu-matmul fp32), not TF32
 * (sl_codelets_setup). */
static int fp32_gpus;

/* The history perf models' footprint: the task's data sizes (StarPU's own,
 * starpu_task_data_footprint), told apart when the GPUs run fp32 matmuls. A GEMM there takes
 * several times its TF32 time for the same sizes, and StarPU keeps a history entry's samples
 * only while it calibrates it (perfmodel_history.c: model->benchmarking), so the two
 * precisions under one footprint leave a host's CUDA history with the first precision run's
 * times, which dmda/dmdas then weigh against the transfers for the other. TF32 runs and runs
 * without GPUs keep StarPU's footprint, and their existing histories. */
static uint32_t footprint(struct starpu_task *task)
{
	uint32_t fp = starpu_task_data_footprint(task);
	return fp32_gpus ? starpu_hash_crc32c_be(1, fp) : fp;
}
/* The reduction methods of the gradients (sl_set_grad_reduction): copies of the add and zero
 * codelets, not the codelets themselves, which tasks use too: StarPU 1.4 changes the access mode
 * of a reduction method's buffer (RW | COMMUTE) and then refuses a task of that codelet given
 * RW (reduce_gradients' add under mpirun with sub-batches in reduction). */
static struct starpu_codelet redux_cls[2];     /* [0] reduce = add, [1] init = zero */

enum starpu_data_access_mode sl_starpu_mode(int32_t access)
{
	if (access & SL_ACCESS_REDUX)
		return STARPU_REDUX;
	if ((access & SL_ACCESS_R) && (access & SL_ACCESS_W))
		return STARPU_RW;
	return (access & SL_ACCESS_W) ? STARPU_W : STARPU_R;
}

/* The buffers of the running task as the body sees them (k: its repeat count). A buffer of
 * mode SL_ANY may have any interface: no pointer. */
static void task_buffers(const struct sl_codelet *c, int k, void *buffers[], int n,
			 struct sl_buf *b)
{
	for (int i = 0; i < n; i++) {
		int decl = c->modes[sl_codelet_declared(c, k, i)];
		if (decl & SL_ANY) {
			b[i] = (struct sl_buf){ NULL, 0, 0 };
			continue;
		}
		b[i] = (struct sl_buf){ (void *)STARPU_VECTOR_GET_PTR(buffers[i]),
					STARPU_VECTOR_GET_NX(buffers[i]),
					STARPU_VECTOR_GET_ELEMSIZE(buffers[i]) };
	}
}

/* The buffer count of the running task of c: the codelet's when fixed; else the task's (a
 * reduction method, run inline inside another task, has fixed ones). */
static int buffer_count(const struct sl_codelet *c)
{
	const struct starpu_codelet *cl = &cls[c->id];
	return cl->nbuffers != STARPU_VARIABLE_NBUFFERS ?
		       cl->nbuffers :
		       (int)STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
}

/* Every task's CPU function calls this: the team of the worker's cores, the trace record
 * around the body (skipped in a dry run). */
static void codelet_cpu(const struct sl_codelet *c, void *buffers[], void *cl_arg)
{
	long slot = sl_trace_begin(c->id, sl_task_threads());
	if (!sl_dry_run()) {
		int n = buffer_count(c);
		struct sl_buf b[n > 0 ? n : 1];
		task_buffers(c, sl_codelet_repeats(c, cl_arg), buffers, n, b);
		c->run(b, n, cl_arg);
	}
	sl_trace_end(slot);
}

#ifdef SL_HAVE_CUDA
/* Each CUDA worker's scratch (cuda_kernels.h), made on its thread when StarPU starts. */
static void *cuda_scratch[STARPU_NMAXWORKERS];

static void scratch_create(void *arg SL_UNUSED)
{
	cuda_scratch[starpu_worker_get_id_check()] = sl_gpu_scratch_create();
}

static void scratch_destroy(void *arg SL_UNUSED)
{
	int w = starpu_worker_get_id_check();
	sl_gpu_scratch_destroy(cuda_scratch[w]);
	cuda_scratch[w] = NULL;
}

void sl_codelets_cuda_workers(int start)
{
	starpu_execute_on_each_worker(start ? scratch_create : scratch_destroy, NULL, STARPU_CUDA);
}

/* Every task's CUDA function calls this: the body queues its kernels on the CUDA worker's
 * stream, with its cuBLAS handle (starpu_cublas_init, at the start), and returns; StarPU
 * waits for the stream (STARPU_CUDA_ASYNC). The trace records the queueing (start_ns, end_ns)
 * and, through two events on the stream, the kernels' run (gpu_start_ns, gpu_end_ns). Skipped
 * in a dry run. */
static void codelet_cuda(const struct sl_codelet *c, void *buffers[], void *cl_arg)
{
	long slot = sl_trace_begin(c->id, 1);
	if (!sl_dry_run()) {
		int n = buffer_count(c);
		struct sl_buf b[n > 0 ? n : 1];
		task_buffers(c, sl_codelet_repeats(c, cl_arg), buffers, n, b);
		struct sl_gpu g = { (void *)starpu_cuda_get_local_stream(),
				    (void *)starpu_cublas_get_local_handle(), sl_gpu_tf32(),
				    cuda_scratch[starpu_worker_get_id_check()] };
		sl_trace_gpu_mark(slot, g.stream, 0);
		c->cuda_run(b, n, cl_arg, &g);
		sl_trace_gpu_mark(slot, g.stream, 1);
	}
	sl_trace_end(slot);
}
#endif

/* Fixed when every buffer's mode is (R, W or RW, none optional or repeated): StarPU then gets
 * them with the codelet; else each task brings its own. */
static int fixed_modes(const struct sl_codelet *c)
{
	for (int i = 0; i < c->nbuffers; i++) {
		int m = c->modes[i];
		if (m != SL_R && m != SL_W && m != SL_RW)
			return 0;
	}
	return 1;
}

static int codelet_id(const char *name)
{
	for (int id = 0; id < sl_codelet_count(); id++)
		if (strcmp(sl_codelet_name(id), name) == 0)
			return id;
	return -1;
}

static void build(void)
{
	int count = sl_codelet_count();
	if (count > SL_MAX_CODELETS) {
		fprintf(stderr, "starpu_llm: %d codelets, room for %d\n", count,
			SL_MAX_CODELETS);
		abort();
	}
	for (int id = 0; id < count; id++) {
		const struct sl_codelet *c = sl_codelet_get(id);
		struct starpu_codelet *cl = &cls[id];
		starpu_codelet_init(cl);     /* its functions: sl_codelets_setup, each start */
		cl->name = c->name;
		if (!(c->flags & SL_NO_PERFMODEL)) {
			snprintf(symbols[id], sizeof symbols[id], "sl_%s", c->name);
			models[id] = (struct starpu_perfmodel){ .type = STARPU_HISTORY_BASED,
								.symbol = symbols[id],
								.footprint = footprint };
			cl->model = &models[id];
		}
		if (fixed_modes(c)) {
			cl->nbuffers = c->nbuffers;
			for (int i = 0; i < c->nbuffers; i++)
				cl->modes[i] = sl_starpu_mode(sl_mode_access(c->modes[i], 0, 0));
		} else {
			cl->nbuffers = STARPU_VARIABLE_NBUFFERS;
		}
	}
	sl_codelet_cpu = codelet_cpu;
#ifdef SL_HAVE_CUDA
	sl_codelet_cuda = codelet_cuda;
#endif
	built = 1;
}

_Static_assert(SL_MAX_BUFFERS <= STARPU_NMAXBUFS, "a codelet's modes must fit in starpu_codelet");

int sl_codelet_where(int codelet, int ncuda)
{
	if (codelet < 0 || codelet >= sl_codelet_count())
		return 0;
	return ncuda > 0 && sl_codelet_get(codelet)->cuda ? SL_ON_CUDA : SL_ON_CPU;
}

int sl_codelet_placed(int codelet)
{
	if (!built || codelet < 0 || codelet >= sl_codelet_count())
		return 0;
	return (cls[codelet].cpu_funcs[0] ? SL_ON_CPU : 0) |
	       (cls[codelet].cuda_funcs[0] ? SL_ON_CUDA : 0);
}

void sl_codelets_setup(int cores_per_worker, int ncuda)
{
	if (!built)
		build();
	fp32_gpus = ncuda > 0 && !sl_gpu_tf32();
	for (int id = 0; id < sl_codelet_count(); id++) {
		const struct sl_codelet *c = sl_codelet_get(id);
		/* where sl_codelet_where says: a CUDA function only when StarPU runs GPUs
		 * (without, the codelets are the CPU build's exactly) */
		int where = sl_codelet_where(id, ncuda);
		cls[id].cpu_funcs[0] = where & SL_ON_CPU ? c->cpu : NULL;
		cls[id].cpu_funcs_name[0] = where & SL_ON_CPU ? c->name : NULL;
		cls[id].cuda_funcs[0] = NULL;
		cls[id].cuda_flags[0] = 0;
#ifdef SL_HAVE_CUDA
		if (where & SL_ON_CUDA) {
			cls[id].cuda_funcs[0] = c->cuda;
			cls[id].cuda_flags[0] = STARPU_CUDA_ASYNC;
		}
#endif
		/* StarPU derives where a codelet runs from its functions at its first task and
		 * keeps it: derived again for this start's functions */
		cls[id].where = 0;
		cls[id].checked = 0;
		if (c->flags & SL_SEQUENTIAL)
			continue;
		cls[id].type = cores_per_worker > 1 ? STARPU_FORKJOIN : STARPU_SEQ;
		cls[id].max_parallelism = cores_per_worker;
	}
	redux_cls[0] = cls[codelet_id("add")];
	redux_cls[1] = cls[codelet_id("zero")];
}

struct starpu_codelet *sl_starpu_codelet(int codelet)
{
	return built && codelet >= 0 && codelet < sl_codelet_count() ? &cls[codelet] : NULL;
}

int sl_set_grad_reduction(sl_handle h)
{
	if (!built)
		return -EINVAL;
	starpu_data_set_reduction_methods(h, &redux_cls[0], &redux_cls[1]);
	return 0;
}
