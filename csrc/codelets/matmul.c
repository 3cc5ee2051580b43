/* Codelets: matmul forward and backward (the linear layers and the tied lm head). */
#include "codelet.h"

struct sl_matmul_args { int N, C, OC, has_bias; };

/* buffers: out (N,OC) W, inp (N,C) R, weight (OC,C) R, [bias (OC) R] */
static void matmul_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_matmul_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_MATMUL_FWD);
	matmul_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2),
		       a->has_bias ? SL_F(buffers, 3) : NULL, a->N, a->C, a->OC);
	sl_task_end(tr);
}

/* buffers: dinp (N,C) W, dweight (OC,C) RW|REDUX, dout (N,OC) R, inp R, weight R, [dbias] */
static void matmul_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_matmul_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_MATMUL_BWD);
	matmul_backward(SL_F(buffers, 0), SL_F(buffers, 1), a->has_bias ? SL_F(buffers, 5) : NULL,
			SL_F(buffers, 2), SL_F(buffers, 3), SL_F(buffers, 4), a->N, a->C, a->OC);
	sl_task_end(tr);
}

static struct starpu_perfmodel matmul_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_matmul_forward" };
static struct starpu_perfmodel matmul_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_matmul_backward" };

/* The bias is optional and the gradient modes are RW or REDUX, so the buffer count and modes
 * come with each task (STARPU_VARIABLE_NBUFFERS) rather than with the codelet. */
static struct starpu_codelet matmul_forward_cl = {
	.cpu_funcs = { matmul_forward_cpu }, .cpu_funcs_name = { "matmul_forward_cpu" },
	.nbuffers = STARPU_VARIABLE_NBUFFERS, .model = &matmul_forward_model,
	.name = "matmul_forward" };
static struct starpu_codelet matmul_backward_cl = {
	.cpu_funcs = { matmul_backward_cpu }, .cpu_funcs_name = { "matmul_backward_cpu" },
	.nbuffers = STARPU_VARIABLE_NBUFFERS, .model = &matmul_backward_model,
	.name = "matmul_backward" };
SL_REGISTER_CODELETS(&matmul_forward_cl, &matmul_backward_cl)

int sl_submit_matmul_forward(sl_handle out, sl_handle inp, sl_handle weight, sl_handle bias,
			     int N, int C, int OC)
{
	struct sl_matmul_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_matmul_args){ N, C, OC, bias != NULL };
	int ret;
	if (bias)
		ret = SL_INSERT(&matmul_forward_cl, STARPU_W, out, STARPU_R, inp, STARPU_R, weight,
				STARPU_R, bias, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0);
	else
		ret = SL_INSERT(&matmul_forward_cl, STARPU_W, out, STARPU_R, inp, STARPU_R, weight,
				STARPU_CL_ARGS_NFREE, a, sizeof *a, 0);
	return sl_check_submit(ret, "matmul_forward");
}

int sl_submit_matmul_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias,
			      sl_handle dout, sl_handle inp, sl_handle weight,
			      int N, int C, int OC, int redux)
{
	struct sl_matmul_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_matmul_args){ N, C, OC, dbias != NULL };
	enum starpu_data_access_mode g = sl_grad_mode(redux);
	int ret;
	if (dbias)
		ret = SL_INSERT(&matmul_backward_cl, STARPU_W, dinp, g, dweight, STARPU_R, dout,
				STARPU_R, inp, STARPU_R, weight, g, dbias,
				STARPU_CL_ARGS_NFREE, a, sizeof *a, 0);
	else
		ret = SL_INSERT(&matmul_backward_cl, STARPU_W, dinp, g, dweight, STARPU_R, dout,
				STARPU_R, inp, STARPU_R, weight, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0);
	return sl_check_submit(ret, "matmul_backward");
}
