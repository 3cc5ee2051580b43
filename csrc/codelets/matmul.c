/* Codelets: matmul forward and backward (the linear layers and the tied lm head). */
#include "codelet.h"

/* out (N,OC), inp (N,C), weight (OC,C), [bias (OC)] */
SL_CODELET(matmul_forward, struct sl_matmul_args, 0,
	   2.0 * a->N * a->C * a->OC + (n > 3 ? (double)a->N * a->OC : 0.0), SL_W, SL_R, SL_R,
	   SL_R | SL_OPT)
{
	matmul_forward(SL_F(0), SL_F(1), SL_F(2), n > 3 ? SL_F(3) : NULL, a->N, a->C, a->OC);
}

/* dinp (N,C), dweight (OC,C), dout (N,OC), inp, weight, [dbias (OC)].
 * dinp = dout weight and dweight += dout^T inp: 2 N C OC flops each; dbias += column sums. */
SL_CODELET(matmul_backward, struct sl_matmul_args, 0,
	   4.0 * a->N * a->C * a->OC + (n > 5 ? (double)a->N * a->OC : 0.0), SL_W, SL_GRAD, SL_R,
	   SL_R, SL_R, SL_GRAD | SL_OPT)
{
	matmul_backward(SL_F(0), SL_F(1), n > 5 ? SL_F(5) : NULL, SL_F(2), SL_F(3), SL_F(4), a->N,
			a->C, a->OC);
}
