/* Codelets that move data rather than compute a layer: the batch load, the zero-fill and the
 * sum used as StarPU's reduction methods for gradients, and the thread/affinity probe. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include "codelet.h"

/* ---- load: inputs/targets from the token shard ---- */
struct sl_load_args { const uint16_t *tokens; size_t pos, n; };

/* buffers: inputs (n) W, targets (n) W */
static void load_batch_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_load_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_LOAD);
	load_batch(SL_I(buffers, 0), SL_I(buffers, 1), a->tokens, a->pos, a->n);
	sl_task_end(tr);
}

static struct starpu_perfmodel load_batch_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_load_batch" };
static struct starpu_codelet load_batch_cl = {
	.cpu_funcs = { load_batch_cpu }, .cpu_funcs_name = { "load_batch_cpu" },
	.nbuffers = 2, .modes = { STARPU_W, STARPU_W },
	.model = &load_batch_model, .name = "load_batch" };

int sl_submit_load_batch(sl_handle inputs, sl_handle targets, const uint16_t *tokens,
			 size_t pos, size_t n)
{
	struct sl_load_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_load_args){ tokens, pos, n };
	return sl_check_submit(SL_INSERT(&load_batch_cl, STARPU_W, inputs, STARPU_W, targets,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "load_batch");
}

/* ---- gradient reduction methods: init = zero, reduce = dst += src ---- */
static void zero_cpu(void *buffers[], void *cl_arg)
{
	(void)cl_arg;
	long tr = sl_task_begin(SL_CL_ZERO);
	fill_zero(SL_F(buffers, 0), STARPU_VECTOR_GET_NX(buffers[0]));
	sl_task_end(tr);
}

static void add_cpu(void *buffers[], void *cl_arg)
{
	(void)cl_arg;
	long tr = sl_task_begin(SL_CL_ADD);
	add_inplace(SL_F(buffers, 0), SL_F(buffers, 1), STARPU_VECTOR_GET_NX(buffers[0]));
	sl_task_end(tr);
}

static struct starpu_perfmodel zero_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_zero" };
static struct starpu_perfmodel add_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_add" };
struct starpu_codelet sl_zero_cl = {
	.cpu_funcs = { zero_cpu }, .cpu_funcs_name = { "zero_cpu" },
	.nbuffers = 1, .modes = { STARPU_W }, .model = &zero_model, .name = "zero" };
/* StarPU 1.3 requires the first buffer of a reduction codelet to be exactly STARPU_RW */
struct starpu_codelet sl_add_cl = {
	.cpu_funcs = { add_cpu }, .cpu_funcs_name = { "add_cpu" },
	.nbuffers = 2, .modes = { STARPU_RW, STARPU_R }, .model = &add_model, .name = "add" };

/* ---- probe: what a task sees of its cores ---- */
struct sl_probe_args { uint64_t *out; int max_threads; };

static void probe_cpu(void *buffers[], void *cl_arg)
{
	(void)buffers;
	const struct sl_probe_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_PROBE);
	int k = omp_get_max_threads();
#pragma omp parallel num_threads(k)
	{
		int t = omp_get_thread_num();
		cpu_set_t set;
		uint64_t mask = 0;
		CPU_ZERO(&set);
		if (sched_getaffinity(0, sizeof set, &set) == 0)
			for (int c = 0; c < 64; c++)
				if (CPU_ISSET(c, &set))
					mask |= (uint64_t)1 << c;
		if (t < a->max_threads)
			a->out[1 + t] = mask;
#pragma omp single
		a->out[0] = (uint64_t)omp_get_num_threads();
	}
	sl_task_end(tr);
}

static struct starpu_codelet probe_cl = {
	.cpu_funcs = { probe_cpu }, .cpu_funcs_name = { "probe_cpu" },
	.nbuffers = 0, .name = "probe" };

int sl_submit_probe(uint64_t *out, int max_threads)
{
	struct sl_probe_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_probe_args){ out, max_threads };
	return sl_check_submit(SL_INSERT(&probe_cl, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0), "probe");
}

/* zero and add stay sequential: StarPU runs reduction tasks on any single worker */
SL_REGISTER_CODELETS(&load_batch_cl, &probe_cl)
