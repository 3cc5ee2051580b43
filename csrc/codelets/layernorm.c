/* Codelets: layernorm forward and backward (ln1, ln2 of every block and the final lnf). */
#include "codelet.h"

struct sl_layernorm_args {
	int N, C, accumulate;
};

/* out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C) */
SL_CODELET(layernorm_forward, SL_W, SL_W, SL_W, SL_R, SL_R, SL_R)
SL_CPU_FUNC(layernorm_forward, struct sl_layernorm_args)
{
	layernorm_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			  SL_F(buffers, 4), SL_F(buffers, 5), a->N, a->C);
}

/* dinp (N,C), dweight, dbias, dout, inp, weight, mean, rstd: eight, the most a codelet of
 * Debian's StarPU build can declare. */
SL_CODELET(layernorm_backward, SL_ACC, SL_GRAD, SL_GRAD, SL_R, SL_R, SL_R, SL_R, SL_R)
SL_CPU_FUNC(layernorm_backward, struct sl_layernorm_args)
{
	layernorm_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			   SL_F(buffers, 4), SL_F(buffers, 5), SL_F(buffers, 6), SL_F(buffers, 7),
			   a->N, a->C, a->accumulate);
}

int sl_submit_layernorm_forward(sl_handle out, sl_handle mean, sl_handle rstd, sl_handle inp,
				sl_handle weight, sl_handle bias, int N, int C)
{
	struct sl_layernorm_args a = { N, C, 0 };
	return SL_SUBMIT(layernorm_forward, a, out, mean, rstd, inp, weight, bias);
}

int sl_submit_layernorm_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias, sl_handle dout,
				 sl_handle inp, sl_handle weight, sl_handle mean, sl_handle rstd,
				 int N, int C, int accumulate, int redux)
{
	struct sl_layernorm_args a = { N, C, accumulate };
	return SL_SUBMIT_EX(layernorm_backward, a, redux, accumulate, 0.0, dinp, dweight, dbias,
			    dout, inp, weight, mean, rstd);
}
