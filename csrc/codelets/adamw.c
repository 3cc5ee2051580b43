/* Codelet: AdamW update of one parameter tensor (or one layer's slice of it). */
#include "codelet.h"

struct sl_adamw_args {
	float lr, beta1, beta2, eps, weight_decay;
	int t;
};

/* params, grads (zeroed after use, ready for the next step's accumulation), m, v: n floats */
SL_CODELET(adamw, SL_RW, SL_RW, SL_RW, SL_RW)
SL_CPU_FUNC(adamw, struct sl_adamw_args)
{
	size_t n = STARPU_VECTOR_GET_NX(buffers[0]);
	adamw_update(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3), n,
		     a->lr, a->beta1, a->beta2, a->eps, a->weight_decay, a->t, 1);
}

int sl_submit_adamw(sl_handle params, sl_handle grads, sl_handle m, sl_handle v, float lr,
		    float beta1, float beta2, float eps, float weight_decay, int t)
{
	struct sl_adamw_args a = { lr, beta1, beta2, eps, weight_decay, t };
	return SL_SUBMIT(adamw, a, params, grads, m, v);
}
