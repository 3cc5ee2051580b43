/* Codelets: encoder (token + position embedding) forward and backward. */
#include "codelet.h"

struct sl_encoder_args {
	int B, T, C, pos; /* pos: position of the first token (generation) */
};

/* out (B,T,C), inp (B,T), wte (Vp,C), wpe (maxT,C): positions pos..pos+T-1 */
SL_CODELET(encoder_forward, SL_W, SL_R, SL_R, SL_R)
SL_CPU_FUNC(encoder_forward, struct sl_encoder_args)
{
	encoder_forward(SL_F(buffers, 0), SL_I(buffers, 1), SL_F(buffers, 2),
			SL_F(buffers, 3) + (size_t)a->pos * a->C, a->B, a->T, a->C);
}

/* dwte, dwpe, dout (B,T,C), inp (B,T) */
SL_CODELET(encoder_backward, SL_GRAD, SL_GRAD, SL_R, SL_R)
SL_CPU_FUNC(encoder_backward, struct sl_encoder_args)
{
	encoder_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_I(buffers, 3),
			 a->B, a->T, a->C);
}

int sl_submit_encoder_forward(sl_handle out, sl_handle inp, sl_handle wte, sl_handle wpe, int B,
			      int T, int C, int pos)
{
	struct sl_encoder_args a = { B, T, C, pos };
	return SL_SUBMIT(encoder_forward, a, out, inp, wte, wpe);
}

int sl_submit_encoder_backward(sl_handle dwte, sl_handle dwpe, sl_handle dout, sl_handle inp, int B,
			       int T, int C, int redux)
{
	struct sl_encoder_args a = { B, T, C, 0 };
	return SL_SUBMIT_EX(encoder_backward, a, redux, 0, 0.0, dwte, dwpe, dout, inp);
}
