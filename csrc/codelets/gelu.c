/* Codelets: GeLU (tanh form) forward and backward. */
#include "codelet.h"

/* out (N), inp (N) */
SL_CODELET(gelu_forward, struct sl_elementwise_args, 0, 0.0, SL_W, SL_R)
{
	gelu_forward(SL_F(0), SL_F(1), a->N);
}
SL_CUDA(gelu_forward)
{
	gelu_forward_cuda(g, SL_F(0), SL_F(1), a->N);
}

/* dinp (N), inp (N), dout (N) */
SL_CODELET(gelu_backward, struct sl_elementwise_args, 0, 0.0, SL_W, SL_R, SL_R)
{
	gelu_backward(SL_F(0), SL_F(1), SL_F(2), a->N);
}
SL_CUDA(gelu_backward)
{
	gelu_backward_cuda(g, SL_F(0), SL_F(1), SL_F(2), a->N);
}
