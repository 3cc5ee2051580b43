/* Codelet: residual add forward. There is no backward task: the gradient of a sum is the
 * incoming gradient itself, so the flow lets both branches read the same dresidual handle
 * instead of copying it (see taskflow.py). */
#include "codelet.h"

/* out (N), inp1 (N), inp2 (N) */
SL_CODELET(residual_forward, struct sl_elementwise_args, 0, 0.0, SL_W, SL_R, SL_R)
{
	residual_forward(SL_F(0), SL_F(1), SL_F(2), a->N);
}
SL_CUDA(residual_forward)
{
	residual_forward_cuda(g, SL_F(0), SL_F(1), SL_F(2), a->N);
}
