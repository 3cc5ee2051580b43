/* Codelets: the global gradient norm for clipping, as tasks. One grad_sumsq task per gradient
 * tensor (slice) writes its sum of squares into its own one-double handle as soon as that
 * gradient is final; norm_sum tasks add several of those handles into another, a tree whose
 * root every AdamW task reads (taskflow.py, norm_tree). */
#include "codelet.h"

/* sumsq (1 double), grad (n floats) */
SL_CODELET(grad_sumsq, struct sl_no_args, 0, 0.0, SL_W, SL_R)
{
	sum_of_squares(SL_D(0), SL_F(1), SL_N(1));
}
SL_CUDA(grad_sumsq)
{
	sum_of_squares_cuda(g, SL_D(0), SL_F(1), SL_N(1));
}

/* out (1 double), in_1 .. in_k (1 double each): a few additions, always on one core */
SL_CODELET_REPEAT(norm_sum, struct sl_norm_sum_args, count, SL_SEQUENTIAL, 0.0, SL_W,
		  SL_R | SL_REPEAT)
{
	int k = n - 1;
	double in[k > 0 ? k : 1];
	for (int i = 0; i < k; i++)
		in[i] = *SL_D(1 + i);
	sum_f64(SL_D(0), in, k);
}
SL_CUDA(norm_sum)
{
	int k = n - 1;
	const double *in[k > 0 ? k : 1];
	for (int i = 0; i < k; i++)
		in[i] = SL_D(1 + i);
	sum_f64_cuda(g, SL_D(0), in, k);
}
