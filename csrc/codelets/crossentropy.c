/* Codelets: softmax + cross-entropy loss over the real vocabulary, forward and backward. */
#include "codelet.h"

struct sl_xent_args { int N, V, Vp; float dloss; };

/* buffers: probs (N,Vp) W, losses (N) W, logits (N,Vp) R, targets (N) R */
static void crossentropy_forward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_xent_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_XENT_FWD);
	crossentropy_softmax_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2),
				     SL_I(buffers, 3), a->N, a->V, a->Vp);
	sl_task_end(tr);
}

/* buffers: dlogits (N,Vp) W, probs (N,Vp) R, targets (N) R */
static void crossentropy_backward_cpu(void *buffers[], void *cl_arg)
{
	const struct sl_xent_args *a = cl_arg;
	long tr = sl_task_begin(SL_CL_XENT_BWD);
	crossentropy_softmax_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_I(buffers, 2),
				      a->N, a->V, a->Vp, a->dloss);
	sl_task_end(tr);
}

static struct starpu_perfmodel crossentropy_forward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_crossentropy_forward" };
static struct starpu_perfmodel crossentropy_backward_model = {
	.type = STARPU_HISTORY_BASED, .symbol = "sl_crossentropy_backward" };

static struct starpu_codelet crossentropy_forward_cl = {
	.cpu_funcs = { crossentropy_forward_cpu },
	.cpu_funcs_name = { "crossentropy_forward_cpu" },
	.nbuffers = 4, .modes = { STARPU_W, STARPU_W, STARPU_R, STARPU_R },
	.model = &crossentropy_forward_model, .name = "crossentropy_forward" };
static struct starpu_codelet crossentropy_backward_cl = {
	.cpu_funcs = { crossentropy_backward_cpu },
	.cpu_funcs_name = { "crossentropy_backward_cpu" },
	.nbuffers = 3, .modes = { STARPU_W, STARPU_R, STARPU_R },
	.model = &crossentropy_backward_model, .name = "crossentropy_backward" };
SL_REGISTER_CODELETS(&crossentropy_forward_cl, &crossentropy_backward_cl)

int sl_submit_crossentropy_forward(sl_handle probs, sl_handle losses, sl_handle logits,
				   sl_handle targets, int N, int V, int Vp)
{
	struct sl_xent_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_xent_args){ N, V, Vp, 0.0f };
	return sl_check_submit(SL_INSERT(&crossentropy_forward_cl, STARPU_W, probs, STARPU_W,
					 losses, STARPU_R, logits, STARPU_R, targets,
					 STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "crossentropy_forward");
}

int sl_submit_crossentropy_backward(sl_handle dlogits, sl_handle probs, sl_handle targets,
				    int N, int V, int Vp, float dloss)
{
	struct sl_xent_args *a = sl_args_alloc(sizeof *a);
	*a = (struct sl_xent_args){ N, V, Vp, dloss };
	return sl_check_submit(SL_INSERT(&crossentropy_backward_cl, STARPU_W, dlogits, STARPU_R,
					 probs, STARPU_R, targets, STARPU_CL_ARGS_NFREE, a, sizeof *a, 0),
			       "crossentropy_backward");
}
