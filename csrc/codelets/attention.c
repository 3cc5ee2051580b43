/* Codelets: causal multi-head self-attention forward and backward. */
#include "codelet.h"

struct sl_attention_args {
	int B, T, C, NH;
};

/* out (B,T,C), preatt (B,NH,T,T), att (B,NH,T,T), qkv (B,T,3C) */
SL_CODELET(attention_forward, SL_W, SL_W, SL_W, SL_R)
SL_CPU_FUNC(attention_forward, struct sl_attention_args)
{
	attention_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			  a->B, a->T, a->C, a->NH);
}

/* dqkv (B,T,3C), scratch (2,B,NH,T,T), dout (B,T,C), qkv, att.
 * dpreatt and datt only live inside the task. STARPU_SCRATCH would fit, but StarPU 1.3.10
 * crashes when a FORKJOIN task under peager gets a buffer StarPU allocated itself, so the
 * scratch is an ordinary handle on our memory, written by every attention_backward. */
SL_CODELET(attention_backward, SL_W, SL_W, SL_R, SL_R, SL_R)
SL_CPU_FUNC(attention_backward, struct sl_attention_args)
{
	float *dpreatt = SL_F(buffers, 1);
	float *datt = dpreatt + (size_t)a->B * a->NH * a->T * a->T;
	attention_backward(SL_F(buffers, 0), dpreatt, datt, SL_F(buffers, 2), SL_F(buffers, 3),
			   SL_F(buffers, 4), a->B, a->T, a->C, a->NH);
}

int sl_submit_attention_forward(sl_handle out, sl_handle preatt, sl_handle att, sl_handle qkv,
				int B, int T, int C, int NH)
{
	struct sl_attention_args a = { B, T, C, NH };
	return SL_SUBMIT(attention_forward, a, out, preatt, att, qkv);
}

int sl_submit_attention_backward(sl_handle dqkv, sl_handle scratch, sl_handle dout, sl_handle qkv,
				 sl_handle att, int B, int T, int C, int NH)
{
	struct sl_attention_args a = { B, T, C, NH };
	return SL_SUBMIT(attention_backward, a, dqkv, scratch, dout, qkv, att);
}
