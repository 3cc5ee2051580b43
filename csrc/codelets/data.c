/* Codelets that move data rather than compute a layer: the batch load, the zero-fill and the
 * sum used as StarPU's reduction methods for gradients (and the ranks' gradient sums), the copy
 * between pipeline stages, the gather of a checkpoint snapshot,
 * and the thread/affinity probe. The load (from a token shard in host memory), the gather
 * (into a Python buffer) and the probe (of CPU cores) run on CPUs only. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <string.h>
#include "codelet.h"

/* inputs (n), targets (n) from tokens[pos .. pos+n] */
SL_CODELET(load_batch, struct sl_load_args, 0, 0.0, SL_W, SL_W)
{
	load_batch(SL_I(0), SL_I(1), a->tokens, a->pos, a->n);
}

/* ---- gradient reduction methods: init = zero, reduce = dst += src ---- */
/* x (n) */
SL_CODELET(zero, struct sl_no_args, SL_SEQUENTIAL, 0.0, SL_W)
{
	fill_zero(SL_F(0), SL_N(0));
}
SL_CUDA(zero)
{
	fill_zero_cuda(g, SL_F(0), SL_N(0));
}

/* dst (n), src (n). StarPU 1.3 requires the first buffer of a reduction codelet to be
 * exactly STARPU_RW */
SL_CODELET(add, struct sl_no_args, SL_SEQUENTIAL, 0.0, SL_RW, SL_R)
{
	add_inplace(SL_F(0), SL_F(1), SL_N(0));
}
SL_CUDA(add)
{
	add_inplace_cuda(g, SL_F(0), SL_F(1), SL_N(0));
}

/* dst (n), src (n): the residual stream's gradient handed from one pipeline stage's backward
 * scratch to the next (flow/taskflow.py, backward); on the receiving stage's rank. */
SL_CODELET(copy, struct sl_no_args, SL_SEQUENTIAL, 0.0, SL_W, SL_R)
{
	copy_floats(SL_F(0), SL_F(1), SL_N(0));
}
SL_CUDA(copy)
{
	copy_floats_cuda(g, SL_F(0), SL_F(1), SL_N(0));
}

/* dst (any interface: e.g. a starpupy handle, whose memory is a->dst), src_1 .. src_k vectors:
 * the sources one after the other into dst (the starpupy face's checkpoint snapshot). */
SL_CODELET_REPEAT(gather, struct sl_gather_args, count, SL_SEQUENTIAL, 0.0, SL_W | SL_ANY,
		  SL_R | SL_REPEAT)
{
	char *out = a->dst;
	for (int i = 1; i < n; i++) {
		size_t bytes = SL_N(i) * b[i].elemsize;
		memcpy(out, b[i].ptr, bytes);
		out += bytes;
	}
}

/* ---- probe: what a task sees of its cores (no buffers) ---- */
/* out[0] = the team's thread count, out[1 + t] = thread t's CPU mask (first 64 cores) */
SL_CODELET(probe, struct sl_probe_args, SL_NO_PERFMODEL, 0.0)
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
