/* Codelets: causal multi-head self-attention forward and backward. */
#include "codelet.h"

struct sl_attention_args { int B, T, C, NH; };

/* buffers: out (B,T,C) W, preatt (B,NH,T,T) W, att (B,NH,T,T) W, qkv (B,T,3C) R */
static void attention_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_attention_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_ATTENTION_FWD);
	attention_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			  a->B, a->T, a->C, a->NH);
	sl_task_end(tr);
}

/* buffers: dqkv (B,T,3C) W, scratch (2,B,NH,T,T) W, dout (B,T,C) R, qkv R, att R.
 * dpreatt and datt only live inside the task. STARPU_SCRATCH would fit, but StarPU 1.3.10
 * crashes when a FORKJOIN task under peager gets a buffer StarPU allocated itself, so the
 * scratch is an ordinary handle on our memory, written by every attention_backward. */
static void attention_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_attention_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_ATTENTION_BWD);
	float *dpreatt = SL_F(buffers, 1);
	float *datt = dpreatt + (size_t)a->B * a->NH * a->T * a->T;
	attention_backward(SL_F(buffers, 0), dpreatt, datt, SL_F(buffers, 2), SL_F(buffers, 3),
			   SL_F(buffers, 4), a->B, a->T, a->C, a->NH);
	sl_task_end(tr);
}

static struct starpu_perfmodel attention_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_attention_forward" };
static struct starpu_perfmodel attention_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_attention_backward" };

static struct starpu_codelet attention_forward_cl = {
	.cpu_funcs = { attention_forward_cpu }, .cpu_funcs_name = { "attention_forward_cpu" },
	.nbuffers = 4, .modes = { STARPU_W, STARPU_W, STARPU_W, STARPU_R },
	.model = &attention_forward_model, .name = "attention_forward" };
static struct starpu_codelet attention_backward_cl = {
	.cpu_funcs = { attention_backward_cpu }, .cpu_funcs_name = { "attention_backward_cpu" },
	.nbuffers = 5, .modes = { STARPU_W, STARPU_W, STARPU_R, STARPU_R, STARPU_R },
	.model = &attention_backward_model, .name = "attention_backward" };
SL_REGISTER_CODELETS(&attention_forward_cl, &attention_backward_cl)

int sl_submit_attention_forward(sl_handle out, sl_handle preatt, sl_handle att, sl_handle qkv,
				int B, int T, int C, int NH)
{
	struct sl_attention_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_attention_args){ B, T, C, NH };
	return sl_check_submit(SL_INSERT(&attention_forward_cl, STARPU_W, out, STARPU_W, preatt,
					 STARPU_W, att, STARPU_R, qkv,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "attention_forward");
}

int sl_submit_attention_backward(sl_handle dqkv, sl_handle scratch, sl_handle dout,
				 sl_handle qkv, sl_handle att, int B, int T, int C, int NH)
{
	struct sl_attention_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_attention_args){ B, T, C, NH };
	return sl_check_submit(SL_INSERT(&attention_backward_cl, STARPU_W, dqkv,
					 STARPU_W, scratch, STARPU_R, dout, STARPU_R, qkv,
					 STARPU_R, att, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "attention_backward");
}
