/* Codelets: residual add forward and backward. The task flow does not submit the backward:
 * the gradient of a sum is the incoming gradient itself, so the flow lets both branches read
 * the same dresidual handle instead of copying it (see taskflow.py). */
#include "codelet.h"

struct sl_residual_args { size_t N; };

/* buffers: out (N) W, inp1 (N) R, inp2 (N) R */
static void residual_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_residual_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_RESIDUAL_FWD);
	residual_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->N);
	sl_task_end(tr);
}

/* buffers: dinp1 (N) RW, dinp2 (N) RW, dout (N) R */
static void residual_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_residual_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_RESIDUAL_BWD);
	residual_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->N);
	sl_task_end(tr);
}

static struct starpu_perfmodel residual_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_residual_forward" };
static struct starpu_perfmodel residual_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_residual_backward" };

static struct starpu_codelet residual_forward_cl = {
	.cpu_funcs = { residual_forward_cpu }, .cpu_funcs_name = { "residual_forward_cpu" },
	.nbuffers = 3, .modes = { STARPU_W, STARPU_R, STARPU_R },
	.model = &residual_forward_model, .name = "residual_forward" };
static struct starpu_codelet residual_backward_cl = {
	.cpu_funcs = { residual_backward_cpu }, .cpu_funcs_name = { "residual_backward_cpu" },
	.nbuffers = 3, .modes = { STARPU_RW, STARPU_RW, STARPU_R },
	.model = &residual_backward_model, .name = "residual_backward" };
SL_REGISTER_CODELETS(&residual_forward_cl, &residual_backward_cl)

int sl_submit_residual_forward(sl_handle out, sl_handle inp1, sl_handle inp2, size_t N)
{
	struct sl_residual_args *a = sl_args_alloc(sizeof *a);
	a->N = N;
	return sl_check_submit(SL_INSERT(&residual_forward_cl, STARPU_W, out, STARPU_R, inp1,
					 STARPU_R, inp2, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "residual_forward");
}

int sl_submit_residual_backward(sl_handle dinp1, sl_handle dinp2, sl_handle dout, size_t N)
{
	struct sl_residual_args *a = sl_args_alloc(sizeof *a);
	a->N = N;
	return sl_check_submit(SL_INSERT(&residual_backward_cl, STARPU_RW, dinp1, STARPU_RW, dinp2,
					 STARPU_R, dout, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "residual_backward");
}
