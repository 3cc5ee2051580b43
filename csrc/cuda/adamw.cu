/* AdamW step (decoupled weight decay, as torch.optim.AdamW and the CPU kernel), element-wise,
 * with the gradient clipping factor read from the GPU's squared norm: no host round trip. */
#include "gpu.h"
#include <math.h>
#include "../kernels/clip.h"

static __global__ void adamw_kernel(float *params, float *grads, float *m, float *v, size_t n,
				    float lr, float beta1, float beta2, float eps,
				    float weight_decay, float bc1, float bc2, const double *sumsq,
				    float max_norm)
{
	float scale = sumsq && max_norm > 0.0f ? sl_clip_scale(*sumsq, max_norm) : 1.0f;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		float gi = grads[i] * scale; /* exact for scale 1 */
		float mi = beta1 * m[i] + (1.0f - beta1) * gi;
		float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
		m[i] = mi;
		v[i] = vi;
		float mhat = mi / bc1, den = sqrtf(vi / bc2);
		float p = params[i];
		params[i] = p - lr * (mhat / (den + eps) + weight_decay * p);
		grads[i] = 0.0f; /* ready for the next step's accumulation */
	}
}

void adamw_cuda(const struct sl_gpu *g, float *params, float *grads, float *m, float *v, size_t n,
		float lr, float beta1, float beta2, float eps, float weight_decay, int t,
		const double *sumsq, float max_norm)
{
	/* the bias corrections as the CPU kernel computes them (in double, then float) */
	const float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
	const float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
	if (n)
		SL_LAUNCH(adamw_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), params, grads, m, v,
			  n, lr, beta1, beta2, eps, weight_decay, bc1, bc2, sumsq, max_norm);
}
