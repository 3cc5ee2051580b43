/* Codelet: AdamW update of one parameter tensor (or one layer's slice of it), with gradient
 * clipping when the task also reads the sum of squares of all gradients (gradnorm.c). */
#include <errno.h>
#include "codelet.h"

struct sl_adamw_args {
	float lr, beta1, beta2, eps, weight_decay;
	int t;
	float max_norm; /* > 0: clip, the task has the optional sumsq buffer */
};

/* params, grads (zeroed after use, ready for the next step's accumulation), m, v: n floats;
 * [sumsq (1 double): the squared global gradient norm; without it, no clipping and no
 * dependency on any other tensor's gradient] */
SL_CODELET(adamw, SL_RW, SL_RW, SL_RW, SL_RW, SL_R | SL_OPT)
SL_CPU_FUNC(adamw, struct sl_adamw_args)
{
	size_t n = STARPU_VECTOR_GET_NX(buffers[0]);
	float scale = 1.0f;
	if (a->max_norm > 0.0f)
		scale = clip_scale(*(const double *)STARPU_VECTOR_GET_PTR(buffers[4]), a->max_norm);
	adamw_update(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3), n,
		     a->lr, a->beta1, a->beta2, a->eps, a->weight_decay, a->t, 1, scale);
}

int sl_submit_adamw(sl_handle params, sl_handle grads, sl_handle m, sl_handle v, sl_handle sumsq,
		    float max_norm, float lr, float beta1, float beta2, float eps,
		    float weight_decay, int t)
{
	if ((sumsq != NULL) != (max_norm > 0.0f))
		return -EINVAL; /* clipping needs the norm, and the norm is only read to clip */
	struct sl_adamw_args a = { lr, beta1, beta2, eps, weight_decay, t, max_norm };
	return SL_SUBMIT(adamw, a, params, grads, m, v, sumsq);
}
