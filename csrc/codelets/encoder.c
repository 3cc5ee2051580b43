/* Codelets: encoder (token + position embedding) forward and backward. */
#include "codelet.h"

struct sl_encoder_args { int B, T, C; };

/* buffers: out (B,T,C) W, inp (B,T) R, wte (Vp,C) R, wpe (maxT,C) R */
static void encoder_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_encoder_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_ENCODER_FWD);
	encoder_forward(SL_F(buffers, 0), SL_I(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			a->B, a->T, a->C);
	sl_task_end(tr);
}

/* buffers: dwte RW|REDUX, dwpe RW|REDUX, dout (B,T,C) R, inp (B,T) R */
static void encoder_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_encoder_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_ENCODER_BWD);
	encoder_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_I(buffers, 3),
			 a->B, a->T, a->C);
	sl_task_end(tr);
}

static struct starpu_perfmodel encoder_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_encoder_forward" };
static struct starpu_perfmodel encoder_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_encoder_backward" };

static struct starpu_codelet encoder_forward_cl = {
	.cpu_funcs = { encoder_forward_cpu }, .cpu_funcs_name = { "encoder_forward_cpu" },
	.nbuffers = 4, .modes = { STARPU_W, STARPU_R, STARPU_R, STARPU_R },
	.model = &encoder_forward_model, .name = "encoder_forward" };
/* gradient modes (RW or REDUX) come with each task */
static struct starpu_codelet encoder_backward_cl = {
	.cpu_funcs = { encoder_backward_cpu }, .cpu_funcs_name = { "encoder_backward_cpu" },
	.nbuffers = STARPU_VARIABLE_NBUFFERS, .model = &encoder_backward_model,
	.name = "encoder_backward" };
SL_REGISTER_CODELETS(&encoder_forward_cl, &encoder_backward_cl)

int sl_submit_encoder_forward(sl_handle out, sl_handle inp, sl_handle wte, sl_handle wpe,
			      int B, int T, int C)
{
	struct sl_encoder_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_encoder_args){ B, T, C };
	return sl_check_submit(SL_INSERT(&encoder_forward_cl, STARPU_W, out, STARPU_R, inp,
					 STARPU_R, wte, STARPU_R, wpe,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "encoder_forward");
}

int sl_submit_encoder_backward(sl_handle dwte, sl_handle dwpe, sl_handle dout, sl_handle inp,
			       int B, int T, int C, int redux)
{
	struct sl_encoder_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_encoder_args){ B, T, C };
	enum starpu_data_access_mode g = sl_grad_mode(redux);
	return sl_check_submit(SL_INSERT(&encoder_backward_cl, g, dwte, g, dwpe, STARPU_R, dout,
					 STARPU_R, inp, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "encoder_backward");
}
