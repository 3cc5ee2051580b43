/* Codelets: GeLU (tanh form) forward and backward. */
#include "codelet.h"

struct sl_gelu_args {
	size_t N;
};

/* out (N), inp (N) */
SL_CODELET(gelu_forward, SL_W, SL_R)
SL_CPU_FUNC(gelu_forward, struct sl_gelu_args)
{
	gelu_forward(SL_F(buffers, 0), SL_F(buffers, 1), a->N);
}

/* dinp (N), inp (N), dout (N) */
SL_CODELET(gelu_backward, SL_W, SL_R, SL_R)
SL_CPU_FUNC(gelu_backward, struct sl_gelu_args)
{
	gelu_backward(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->N);
}

int sl_submit_gelu_forward(sl_handle out, sl_handle inp, size_t N)
{
	struct sl_gelu_args a = { N };
	return SL_SUBMIT(gelu_forward, a, out, inp);
}

int sl_submit_gelu_backward(sl_handle dinp, sl_handle inp, sl_handle dout, size_t N)
{
	struct sl_gelu_args a = { N };
	return SL_SUBMIT(gelu_backward, a, dinp, inp, dout);
}
