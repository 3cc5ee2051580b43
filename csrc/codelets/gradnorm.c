/* Codelets: the global gradient norm for clipping, as StarPU tasks. One grad_sumsq task per
 * gradient tensor (slice) writes its sum of squares into its own one-double handle as soon
 * as that gradient is final; norm_sum tasks add up to SL_MAX_BUFFERS - 1 of those handles
 * into another, a tree whose root every AdamW task reads (taskflow.py, norm_tree). */
#include <errno.h>
#include "codelet.h"

/* sumsq (1 double), grad (n floats) */
SL_CODELET(grad_sumsq, SL_W, SL_R)
SL_CPU_FUNC(grad_sumsq, void)
{
	sum_of_squares((double *)STARPU_VECTOR_GET_PTR(buffers[0]), SL_F(buffers, 1),
		       STARPU_VECTOR_GET_NX(buffers[1]));
}

/* out (1 double), in_1 .. in_k (1 double each), k <= SL_MAX_BUFFERS - 1: the buffer count
 * varies per task, so the declared modes are W then R, R | OPT, ...: a task leaves out the
 * trailing inputs it does not have. A few additions: always on one core. */
struct sl_norm_sum_args {
	int k;
};

SL_SEQ_CODELET(norm_sum, SL_W, SL_R, SL_R | SL_OPT, SL_R | SL_OPT, SL_R | SL_OPT, SL_R | SL_OPT,
	       SL_R | SL_OPT, SL_R | SL_OPT)
SL_CPU_FUNC(norm_sum, struct sl_norm_sum_args)
{
	double in[SL_MAX_BUFFERS];
	int k = a->k;
	for (int i = 0; i < k; i++)
		in[i] = *(const double *)STARPU_VECTOR_GET_PTR(buffers[1 + i]);
	sum_f64((double *)STARPU_VECTOR_GET_PTR(buffers[0]), in, k);
}

int sl_submit_grad_sumsq(sl_handle sumsq, sl_handle grad)
{
	return sl_submit(&grad_sumsq_codelet, SL_HANDLES(sumsq, grad), 0, 0, NULL, 0, 0.0);
}

int sl_submit_norm_sum(sl_handle out, const sl_handle *in, int n)
{
	if (n < 1 || n > SL_MAX_BUFFERS - 1)
		return -EINVAL;
	sl_handle h[SL_MAX_BUFFERS] = { out };
	for (int i = 0; i < n; i++)
		h[1 + i] = in[i];
	struct sl_norm_sum_args a = { n };
	return sl_submit(&norm_sum_codelet, h, 1 + n, 0, 0, &a, sizeof a, 0.0);
}
