/* Codelets: encoder (token + position embedding) forward and backward. */
#include "codelet.h"

/* out (B,T,C), inp (B,T), wte (Vp,C), wpe (maxT,C): positions pos..pos+T-1 */
SL_CODELET(encoder_forward, struct sl_encoder_args, 0, 0.0, SL_W, SL_R, SL_R, SL_R)
{
	encoder_forward(SL_F(0), SL_I(1), SL_F(2), SL_F(3) + (size_t)a->pos * a->C, a->B, a->T,
			a->C);
}

/* dwte, dwpe, dout (B,T,C), inp (B,T) */
SL_CODELET(encoder_backward, struct sl_encoder_backward_args, 0, 0.0, SL_GRAD, SL_GRAD, SL_R, SL_R)
{
	encoder_backward(SL_F(0), SL_F(1), SL_F(2), SL_I(3), a->B, a->T, a->C);
}
