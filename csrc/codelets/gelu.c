/* Codelets: GeLU (tanh form) forward and backward. */
#include "codelet.h"

struct sl_gelu_args { size_t N; };

/* buffers: out (N) W, inp (N) R */
static void gelu_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_gelu_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_GELU_FWD);
	gelu_forward(SL_F(buffers, 0), SL_F(buffers, 1), a->N);
	sl_task_end(tr);
}

/* buffers: dinp (N) W, inp (N) R, dout (N) R */
static void gelu_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_gelu_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_GELU_BWD);
	gelu_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->N);
	sl_task_end(tr);
}

static struct starpu_perfmodel gelu_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_gelu_forward" };
static struct starpu_perfmodel gelu_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_gelu_backward" };

static struct starpu_codelet gelu_forward_cl = {
	.cpu_funcs = { gelu_forward_cpu }, .cpu_funcs_name = { "gelu_forward_cpu" },
	.nbuffers = 2, .modes = { STARPU_W, STARPU_R },
	.model = &gelu_forward_model, .name = "gelu_forward" };
static struct starpu_codelet gelu_backward_cl = {
	.cpu_funcs = { gelu_backward_cpu }, .cpu_funcs_name = { "gelu_backward_cpu" },
	.nbuffers = 3, .modes = { STARPU_W, STARPU_R, STARPU_R },
	.model = &gelu_backward_model, .name = "gelu_backward" };
SL_REGISTER_CODELETS(&gelu_forward_cl, &gelu_backward_cl)

int sl_submit_gelu_forward(sl_handle out, sl_handle inp, size_t N)
{
	struct sl_gelu_args *a = sl_args_alloc(sizeof *a);
	a->N = N;
	return sl_check_submit(SL_INSERT(&gelu_forward_cl, STARPU_W, out, STARPU_R, inp,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "gelu_forward");
}

int sl_submit_gelu_backward(sl_handle dinp, sl_handle inp, sl_handle dout, size_t N)
{
	struct sl_gelu_args *a = sl_args_alloc(sizeof *a);
	a->N = N;
	return sl_check_submit(SL_INSERT(&gelu_backward_cl, STARPU_W, dinp, STARPU_R, inp,
					 STARPU_R, dout, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "gelu_backward");
}
