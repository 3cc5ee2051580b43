/* Codelets that move data rather than compute a layer: the batch load, the zero-fill and the
 * sum used as StarPU's reduction methods for gradients, and the thread/affinity probe. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include "codelet.h"

/* ---- load: inputs/targets from the token shard ---- */
struct sl_load_args {
	const uint16_t *tokens;
	size_t pos, n;
};

/* inputs (n), targets (n) */
SL_CODELET(load_batch, SL_W, SL_W)
SL_CPU_FUNC(load_batch, struct sl_load_args)
{
	load_batch(SL_I(buffers, 0), SL_I(buffers, 1), a->tokens, a->pos, a->n);
}

int sl_submit_load_batch(sl_handle inputs, sl_handle targets, const uint16_t *tokens, size_t pos,
			 size_t n)
{
	struct sl_load_args a = { tokens, pos, n };
	return SL_SUBMIT(load_batch, a, inputs, targets);
}

/* ---- gradient reduction methods: init = zero, reduce = dst += src ---- */
SL_REDUCTION_CODELET(zero, SL_W)
SL_CPU_FUNC(zero, void) { fill_zero(SL_F(buffers, 0), STARPU_VECTOR_GET_NX(buffers[0])); }

/* StarPU 1.3 requires the first buffer of a reduction codelet to be exactly STARPU_RW */
SL_REDUCTION_CODELET(add, SL_RW, SL_R)
SL_CPU_FUNC(add, void)
{
	add_inplace(SL_F(buffers, 0), SL_F(buffers, 1), STARPU_VECTOR_GET_NX(buffers[0]));
}

int sl_set_grad_reduction(sl_handle h)
{
	starpu_data_set_reduction_methods(h, &add_codelet.cl, &zero_codelet.cl);
	return 0;
}

/* ---- probe: what a task sees of its cores ---- */
struct sl_probe_args {
	uint64_t *out;
	int max_threads;
};

/* no buffers, no perf model */
SL_CODELET_DEF(probe, NULL, 0)
SL_CPU_FUNC(probe, struct sl_probe_args)
{
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
}

int sl_submit_probe(uint64_t *out, int max_threads)
{
	struct sl_probe_args a = { out, max_threads };
	return sl_submit(&probe_codelet, NULL, 0, 0, 0, &a, sizeof a, 0.0);
}
