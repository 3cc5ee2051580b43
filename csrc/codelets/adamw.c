/* Codelet: AdamW update of one parameter tensor (or one layer's slice of it). */
#include "codelet.h"

struct sl_adamw_args { float lr, beta1, beta2, eps, weight_decay; int t; };

/* buffers: params RW, grads RW (zeroed after use, ready for the next step's accumulation),
 *          m RW, v RW: all n floats */
static void adamw_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_adamw_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_ADAMW);
	size_t n = STARPU_VECTOR_GET_NX(buffers[0]);
	adamw_update(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3), n,
		     a->lr, a->beta1, a->beta2, a->eps, a->weight_decay, a->t, 1);
	sl_task_end(tr);
}

static struct starpu_perfmodel adamw_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_adamw" };

static struct starpu_codelet adamw_cl = {
	.cpu_funcs = { adamw_cpu }, .cpu_funcs_name = { "adamw_cpu" },
	.nbuffers = 4, .modes = { STARPU_RW, STARPU_RW, STARPU_RW, STARPU_RW },
	.model = &adamw_model, .name = "adamw" };
SL_REGISTER_CODELETS(&adamw_cl)

int sl_submit_adamw(sl_handle params, sl_handle grads, sl_handle m, sl_handle v, float lr,
		    float beta1, float beta2, float eps, float weight_decay, int t)
{
	struct sl_adamw_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_adamw_args){ lr, beta1, beta2, eps, weight_decay, t };
	return sl_check_submit(SL_INSERT(&adamw_cl, STARPU_RW, params, STARPU_RW, grads,
					 STARPU_RW, m, STARPU_RW, v,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "adamw");
}
