/* Codelet: AdamW update of one parameter tensor (or one layer's slice of it), with gradient
 * clipping when the task also reads the sum of squares of all gradients (gradnorm.c). */
#include "codelet.h"

/* params, grads (zeroed after use, ready for the next step's accumulation), m, v: n floats;
 * [sumsq (1 double): the squared global gradient norm; without it, no clipping and no
 * dependency on any other tensor's gradient] */
SL_CODELET(adamw, struct sl_adamw_args, 0, 0.0, SL_RW, SL_RW, SL_RW, SL_RW, SL_R | SL_OPT)
{
	float scale = n > 4 && a->max_norm > 0.0f ? clip_scale(*SL_D(4), a->max_norm) : 1.0f;
	adamw_update(SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_N(0), a->lr, a->beta1, a->beta2, a->eps,
		     a->weight_decay, a->t, 1, scale);
}
SL_CUDA(adamw)
{
	adamw_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_N(0), a->lr, a->beta1, a->beta2, a->eps,
		   a->weight_decay, a->t, n > 4 ? SL_D(4) : NULL, a->max_norm);
}
