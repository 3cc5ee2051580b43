/* Codelet: residual add forward. There is no backward task: the gradient of a sum is the
 * incoming gradient itself, so the flow lets both branches read the same dresidual handle
 * instead of copying it (see taskflow.py). */
#include "codelet.h"

struct sl_residual_args {
	size_t N;
};

/* out (N), inp1 (N), inp2 (N) */
SL_CODELET(residual_forward, SL_W, SL_R, SL_R)
SL_CPU_FUNC(residual_forward, struct sl_residual_args)
{
	residual_forward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->N);
}

int sl_submit_residual_forward(sl_handle out, sl_handle inp1, sl_handle inp2, size_t N)
{
	struct sl_residual_args a = { N };
	return SL_SUBMIT(residual_forward, a, out, inp1, inp2);
}
