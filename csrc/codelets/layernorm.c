/* Codelets: layernorm forward and backward (ln1, ln2 of every block and the final lnf). */
#include "codelet.h"

struct sl_layernorm_args { int N, C, accumulate; };

/* buffers: out (N,C) W, mean (N) W, rstd (N) W, inp (N,C) R, weight (C) R, bias (C) R */
static void layernorm_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_layernorm_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_LAYERNORM_FWD);
	layernorm_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			  SL_F(buffers, 4), SL_F(buffers, 5), a->N, a->C);
	sl_task_end(tr);
}

/* buffers: dinp (N,C) W or RW, dweight RW|REDUX, dbias RW|REDUX, dout R, inp R, weight R,
 *          mean R, rstd R: eight, the most a codelet of this StarPU build can declare. */
static void layernorm_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_layernorm_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_LAYERNORM_BWD);
	layernorm_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			   SL_F(buffers, 4), SL_F(buffers, 5), SL_F(buffers, 6), SL_F(buffers, 7),
			   a->N, a->C, a->accumulate);
	sl_task_end(tr);
}

static struct starpu_perfmodel layernorm_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_layernorm_forward" };
static struct starpu_perfmodel layernorm_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_layernorm_backward" };

static struct starpu_codelet layernorm_forward_cl = {
	.cpu_funcs = { layernorm_forward_cpu }, .cpu_funcs_name = { "layernorm_forward_cpu" },
	.nbuffers = 6,
	.modes = { STARPU_W, STARPU_W, STARPU_W, STARPU_R, STARPU_R, STARPU_R },
	.model = &layernorm_forward_model, .name = "layernorm_forward" };
/* dinp is W or RW (accumulate) and the gradients RW or REDUX: modes come with each task */
static struct starpu_codelet layernorm_backward_cl = {
	.cpu_funcs = { layernorm_backward_cpu }, .cpu_funcs_name = { "layernorm_backward_cpu" },
	.nbuffers = STARPU_VARIABLE_NBUFFERS, .model = &layernorm_backward_model,
	.name = "layernorm_backward" };
SL_REGISTER_CODELETS(&layernorm_forward_cl, &layernorm_backward_cl)

int sl_submit_layernorm_forward(sl_handle out, sl_handle mean, sl_handle rstd, sl_handle inp,
				sl_handle weight, sl_handle bias, int N, int C)
{
	struct sl_layernorm_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_layernorm_args){ N, C, 0 };
	return sl_check_submit(SL_INSERT(&layernorm_forward_cl, STARPU_W, out, STARPU_W, mean,
					 STARPU_W, rstd, STARPU_R, inp, STARPU_R, weight,
					 STARPU_R, bias, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "layernorm_forward");
}

int sl_submit_layernorm_backward(sl_handle dinp, sl_handle dweight, sl_handle dbias,
				 sl_handle dout, sl_handle inp, sl_handle weight,
				 sl_handle mean, sl_handle rstd, int N, int C,
				 int accumulate, int redux)
{
	struct sl_layernorm_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_layernorm_args){ N, C, accumulate };
	enum starpu_data_access_mode g = sl_grad_mode(redux);
	return sl_check_submit(SL_INSERT(&layernorm_backward_cl,
					 accumulate ? STARPU_RW : STARPU_W, dinp, g, dweight,
					 g, dbias, STARPU_R, dout, STARPU_R, inp, STARPU_R, weight,
					 STARPU_R, mean, STARPU_R, rstd,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "layernorm_backward");
}
