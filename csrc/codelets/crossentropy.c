/* Codelets: softmax + cross-entropy loss over the real vocabulary, forward and backward. */
#include "codelet.h"

struct sl_xent_args {
	int N, V, Vp;
	float dloss;
};

/* probs (N,Vp), losses (N), logits (N,Vp), targets (N) */
SL_CODELET(crossentropy_forward, SL_W, SL_W, SL_R, SL_R)
SL_CPU_FUNC(crossentropy_forward, struct sl_xent_args)
{
	crossentropy_softmax_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2),
				     SL_I(buffers, 3), a->N, a->V, a->Vp);
}

/* dlogits (N,Vp), probs (N,Vp), targets (N) */
SL_CODELET(crossentropy_backward, SL_W, SL_R, SL_R)
SL_CPU_FUNC(crossentropy_backward, struct sl_xent_args)
{
	crossentropy_softmax_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_I(buffers, 2), a->N,
				      a->V, a->Vp, a->dloss);
}

int sl_submit_crossentropy_forward(sl_handle probs, sl_handle losses, sl_handle logits,
				   sl_handle targets, int N, int V, int Vp)
{
	struct sl_xent_args a = { N, V, Vp, 0.0f };
	return SL_SUBMIT(crossentropy_forward, a, probs, losses, logits, targets);
}

int sl_submit_crossentropy_backward(sl_handle dlogits, sl_handle probs, sl_handle targets, int N,
				    int V, int Vp, float dloss)
{
	struct sl_xent_args a = { N, V, Vp, dloss };
	return SL_SUBMIT(crossentropy_backward, a, dlogits, probs, targets);
}
