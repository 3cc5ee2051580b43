/* Codelets: matmul forward and backward (the linear layers and the tied lm head). */
#include "codelet.h"

struct sl_matmul_args {
	int N, C, OC, has_bias;
};

/* out (N,OC), inp (N,C), weight (OC,C), [bias (OC)] */
SL_CODELET(matmul_forward, SL_W, SL_R, SL_R, SL_R | SL_OPT)
SL_CPU_FUNC(matmul_forward, struct sl_matmul_args)
{
	matmul_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2),
		       a->has_bias ? SL_F(buffers, 3) : NULL, a->N, a->C, a->OC);
}

/* dinp (N,C), dweight (OC,C), dout (N,OC), inp, weight, [dbias (OC)] */
SL_CODELET(matmul_backward, SL_W, SL_GRAD, SL_R, SL_R, SL_R, SL_GRAD | SL_OPT)
SL_CPU_FUNC(matmul_backward, struct sl_matmul_args)
{
	matmul_backward(SL_F(buffers, 0), SL_F(buffers, 1), a->has_bias ? SL_F(buffers, 5) : NULL,
			SL_F(buffers, 2), SL_F(buffers, 3), SL_F(buffers, 4), a->N, a->C, a->OC);
}

int sl_submit_matmul_forward(sl_handle out, sl_handle inp, sl_handle weight, sl_handle bias, int N,
			     int C, int OC)
{
	struct sl_matmul_args a = { N, C, OC, bias != NULL };
	double flops = 2.0 * N * C * OC + (bias ? (double)N * OC : 0.0);
	return SL_SUBMIT_EX(matmul_forward, a, 0, 0, flops, out, inp, weight, bias);
}

int sl_submit_matmul_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias, sl_handle dout,
			      sl_handle inp, sl_handle weight, int N, int C, int OC, int redux)
{
	struct sl_matmul_args a = { N, C, OC, dbias != NULL };
	/* dinp = dout weight, dweight += dout^T inp: 2NC OC each; dbias += column sums of dout */
	double flops = 4.0 * N * C * OC + (dbias ? (double)N * OC : 0.0);
	return SL_SUBMIT_EX(matmul_backward, a, redux, 0, flops, dinp, dweight, dout, inp, weight,
			    dbias);
}
