/* Codelets: layernorm forward and backward (ln1, ln2 of every block and the final lnf). */
#include "codelet.h"

/* out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C) */
SL_CODELET(layernorm_forward, struct sl_layernorm_args, 0, 0.0, SL_W, SL_W, SL_W, SL_R, SL_R,
	   SL_R)
{
	layernorm_forward(SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5), a->N, a->C);
}
SL_CUDA(layernorm_forward)
{
	layernorm_forward_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5), a->N, a->C);
}

/* dinp (N,C), dweight (C), dbias (C), dout (N,C), inp (N,C), weight (C), mean (N), rstd (N):
 * eight, the most a codelet of Debian's StarPU build can declare. dinp is written, or added
 * into when a->accumulate. */
SL_CODELET_ACC(layernorm_backward, struct sl_layernorm_backward_args, accumulate, 0, 0.0, SL_ACC,
	       SL_GRAD, SL_GRAD, SL_R, SL_R, SL_R, SL_R, SL_R)
{
	layernorm_backward(SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5), SL_F(6), SL_F(7),
			   a->N, a->C, a->accumulate);
}
SL_CUDA(layernorm_backward)
{
	layernorm_backward_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5), SL_F(6),
				SL_F(7), a->N, a->C, a->accumulate);
}
