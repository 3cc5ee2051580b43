/* Codelets: softmax + cross-entropy loss over the real vocabulary, forward and backward. */
#include "codelet.h"

/* probs (N,Vp), losses (N), logits (N,Vp), targets (N): losses written, or added into when
 * a->accumulate (a gradient accumulation's later micro-batches) */
SL_CODELET_ACC(crossentropy_forward, struct sl_xent_args, accumulate, 0, 0.0, SL_W, SL_ACC, SL_R,
	       SL_R)
{
	crossentropy_softmax_forward(SL_F(0), SL_F(1), SL_F(2), SL_I(3), a->N, a->V, a->Vp,
				     a->accumulate);
}
SL_CUDA(crossentropy_forward)
{
	crossentropy_forward_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_I(3), a->N, a->V, a->Vp,
				  a->accumulate);
}

/* dlogits (N,Vp), probs (N,Vp), targets (N) */
SL_CODELET(crossentropy_backward, struct sl_xent_backward_args, 0, 0.0, SL_W, SL_R, SL_R)
{
	crossentropy_softmax_backward(SL_F(0), SL_F(1), SL_I(2), a->N, a->V, a->Vp, a->dloss);
}
SL_CUDA(crossentropy_backward)
{
	crossentropy_backward_cuda(g, SL_F(0), SL_F(1), SL_I(2), a->N, a->V, a->Vp, a->dloss);
}
