/* AdamW optimizer step (decoupled weight decay, as torch.optim.AdamW). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#if defined(__AVX__) || defined(__SSE__)
#include <immintrin.h>
#endif

#define ADAMW_BLK 2048

/* x = sqrt(x) on n floats.  Why not a plain sqrtf loop: sqrtf may set errno, so without
 * -fno-math-errno GCC keeps a scalar call per element, which makes the update compute-bound
 * instead of memory-bound. The SIMD square roots
 * below are the same correctly rounded IEEE operation, just without errno. */
static void sqrt_inplace(float *x, size_t n)
{
	size_t i = 0;
#if defined(__AVX__)
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#elif defined(__SSE__)
	for (; i + 4 <= n; i += 4)
		_mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
	for (; i < n; i++)
		x[i] = sqrtf(x[i]);
}

// params, grads, m, v (n); t is the 1-based step; the gradient is grad_scale * grads
void adamw_update(float *params, float *grads, float *m, float *v, size_t n, float lr, float beta1,
		  float beta2, float eps, float weight_decay, int t, int zero_grad,
		  float grad_scale)
{
	/* bias corrections in double: for beta2 = 0.999, 1 - beta2^t is ~t * 1e-3 early on and
	 * computing it in float would lose digits to cancellation */
	const float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
	const float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
	/* blocks of 2048 floats: the block's vhat buffer and arrays stay in L1/L2 between the
	 * three passes */
	size_t nblk = (n + ADAMW_BLK - 1) / ADAMW_BLK;
#pragma omp parallel for schedule(static) if (n > 32768)
	for (size_t kb = 0; kb < nblk; kb++) {
		size_t i0 = kb * ADAMW_BLK;
		size_t len = n - i0 < ADAMW_BLK ? n - i0 : ADAMW_BLK;
		float *p = params + i0, *g = grads + i0, *mb = m + i0, *vb = v + i0;
		float den[ADAMW_BLK];
#pragma omp simd
		for (size_t i = 0; i < len; i++) {
			float gi = g[i] * grad_scale; /* exact for grad_scale 1 */
			float mi = beta1 * mb[i] + (1.0f - beta1) * gi;
			float vi = beta2 * vb[i] + (1.0f - beta2) * gi * gi;
			mb[i] = mi;
			vb[i] = vi;
			den[i] = vi / bc2; // vhat
		}
		sqrt_inplace(den, len);
#pragma omp simd
		for (size_t i = 0; i < len; i++) {
			float mhat = mb[i] / bc1;
			float pi = p[i];
			p[i] = pi - lr * (mhat / (den[i] + eps) + weight_decay * pi);
		}
		if (zero_grad) {
#pragma omp simd
			for (size_t i = 0; i < len; i++)
				g[i] = 0.0f;
		}
	}
}
