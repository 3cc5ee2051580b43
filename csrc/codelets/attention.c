/* Codelets: causal multi-head self-attention forward and backward. */
#include "codelet.h"

/* out (B,T,C), preatt (B,NH,T,T), att (B,NH,T,T), qkv (B,T,3C) */
SL_CODELET(attention_forward, struct sl_attention_args, 0, 0.0, SL_W, SL_W, SL_W, SL_R)
{
	attention_forward(SL_F(0), SL_F(1), SL_F(2), SL_F(3), a->B, a->T, a->C, a->NH);
}

/* dqkv (B,T,3C), scratch (2,B,NH,T,T), dout (B,T,C), qkv, att.
 * dpreatt and datt only live inside the task. STARPU_SCRATCH would fit, but StarPU 1.3.10
 * crashes when a FORKJOIN task under peager gets a buffer StarPU allocated itself, so the
 * scratch is an ordinary handle on our memory, written by every attention_backward. */
SL_CODELET(attention_backward, struct sl_attention_args, 0, 0.0, SL_W, SL_W, SL_R, SL_R, SL_R)
{
	float *dpreatt = SL_F(1);
	float *datt = dpreatt + (size_t)a->B * a->NH * a->T * a->T;
	attention_backward(SL_F(0), dpreatt, datt, SL_F(2), SL_F(3), SL_F(4), a->B, a->T, a->C,
			   a->NH);
}
