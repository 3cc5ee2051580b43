/* Codelets: causal multi-head self-attention forward and backward. */
#include "codelet.h"

/* The flops: query t of a head meets keys 0..t, so B NH T(T+1)/2 (query, key) pairs, each a
 * dot product q.k and an update o += a v of hs multiply-adds: 2 B T(T+1) C flops forward
 * (NH hs = C); the backward's four products per pair (datt, dv, dq, dk) twice that; the
 * softmax's few operations per pair are not counted. Counted, not 0: the scores grow as T^2
 * and the inputs as T, so the cost model needs the flops to carry the attention from the
 * calibration's T to another. */
#define SL_ATTENTION_FLOPS(a) (2.0 * (a)->B * (a)->T * ((a)->T + 1.0) * (a)->C)

/* out (B,T,C), att (B,NH,T,T), qkv (B,T,3C) */
SL_CODELET(attention_forward, struct sl_attention_args, 0, SL_ATTENTION_FLOPS(a), SL_W, SL_W,
	   SL_R)
{
	attention_forward(SL_F(0), SL_F(1), SL_F(2), a->B, a->T, a->C, a->NH);
}
SL_CUDA(attention_forward)
{
	attention_forward_cuda(g, SL_F(0), SL_F(1), SL_F(2), a->B, a->T, a->C, a->NH);
}

/* attention_backward's scratch (2,B,NH,T,T): dpreatt, then datt, where this points. */
static inline float *attention_datt(const struct sl_attention_args *a, float *scratch)
{
	return scratch + (size_t)a->B * a->NH * a->T * a->T;
}

/* dqkv (B,T,3C), scratch (2,B,NH,T,T), dout (B,T,C), qkv, att.
 * dpreatt and datt only live inside the task. STARPU_SCRATCH would fit, but StarPU 1.3.10
 * crashes when a FORKJOIN task under peager gets a buffer StarPU allocated itself, so the
 * scratch is an ordinary handle on our memory, written by every attention_backward. */
SL_CODELET(attention_backward, struct sl_attention_args, 0, 2.0 * SL_ATTENTION_FLOPS(a), SL_W,
	   SL_W, SL_R, SL_R, SL_R)
{
	attention_backward(SL_F(0), SL_F(1), attention_datt(a, SL_F(1)), SL_F(2), SL_F(3), SL_F(4),
			   a->B, a->T, a->C, a->NH);
}
SL_CUDA(attention_backward)
{
	attention_backward_cuda(g, SL_F(0), SL_F(1), attention_datt(a, SL_F(1)), SL_F(2), SL_F(3),
				SL_F(4), a->B, a->T, a->C, a->NH);
}

/* The fused attention (kernels.h, attention_flash_*): its own codelets, since what the forward
 * leaves for the backward differs (lse (B,NH,T) instead of att (B,NH,T,T)) and a codelet's
 * buffers are shared by its CPU and CUDA bodies. The CPU body is the same tiled algorithm, so
 * the flow that a GPU run submits runs, and is tested, with StarPU on CPUs too. The backward
 * recomputes the scores: five products per (query, key) pair (q.k, dy.v, dq, dk, dv), 2.5
 * times the forward's two. */

/* out (B,T,C), lse (B,NH,T), qkv (B,T,3C) */
SL_CODELET(attention_flash_forward, struct sl_attention_args, 0, SL_ATTENTION_FLOPS(a), SL_W,
	   SL_W, SL_R)
{
	attention_flash_forward(SL_F(0), SL_F(1), SL_F(2), a->B, a->T, a->C, a->NH);
}
SL_CUDA(attention_flash_forward)
{
	attention_flash_forward_cuda(g, SL_F(0), SL_F(1), SL_F(2), a->B, a->T, a->C, a->NH);
}

/* dqkv (B,T,3C), dsum (B,NH,T) scratch, dout (B,T,C), qkv, out (B,T,C), lse (B,NH,T) */
SL_CODELET(attention_flash_backward, struct sl_attention_args, 0, 2.5 * SL_ATTENTION_FLOPS(a),
	   SL_W, SL_W, SL_R, SL_R, SL_R, SL_R)
{
	attention_flash_backward(SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5), a->B, a->T,
				 a->C, a->NH);
}
SL_CUDA(attention_flash_backward)
{
	attention_flash_backward_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_F(4), SL_F(5),
				      a->B, a->T, a->C, a->NH);
}
