/* Softmax over the real vocabulary + cross-entropy loss, forward and backward. */
#include "gpu.h"

#define XENT_THREADS 512

/* A block per row (the loss written, or added when accumulate): the max and the normaliser
 * in one pass (each thread's running sum in
 * double, rescaled when its max grows; the normaliser of ~50k terms is summed in double, as
 * on the CPU), then probs = exp(x - max) / sum over the V real columns, 0 beyond; the loss as
 * log(sum) - (x_target - max): accurate even where the probability underflows. */
static __global__ void crossentropy_forward_kernel(float *probs, float *losses,
						   const float *logits, const int32_t *targets,
						   int N, int V, int Vp, int accumulate)
{
	__shared__ float fscratch[32];
	__shared__ double dscratch[32];
	for (int i = blockIdx.x; i < N; i += gridDim.x) {
		const float *x = logits + (size_t)i * Vp;
		float *p = probs + (size_t)i * Vp;
		float m = -INFINITY;
		double s = 0.0;
		for (int j = threadIdx.x; j < V; j += blockDim.x) {
			float xj = x[j];
			if (xj > m) {
				s *= exp((double)m - (double)xj);
				m = xj;
			}
			/* -inf columns add 0 (the CPU's vexpf(-inf)), also while the thread has seen
			 * nothing else: expf(-inf - -inf) would make its sum NaN */
			s += m == -INFINITY ? 0.0f : expf(xj - m);
		}
		float mx = sl_block_max(m, fscratch);
		/* a thread that saw no column (m = -inf) adds 0 */
		double sum = sl_block_sum(m == -INFINITY ? 0.0 : s * exp((double)m - (double)mx),
					  dscratch);
		float inv = (float)(1.0 / sum);
		for (int j = threadIdx.x; j < Vp; j += blockDim.x)
			p[j] = j < V ? expf(x[j] - mx) * inv : 0.0f;
		if (threadIdx.x == 0) {
			float loss = (float)(log(sum) - ((double)x[targets[i]] - (double)mx));
			losses[i] = accumulate ? losses[i] + loss : loss;
		}
	}
}

/* dlogits = (probs - onehot(target)) dloss over the V real columns, 0 beyond; each element
 * reads its own probability before writing: dlogits may be probs */
static __global__ void crossentropy_backward_kernel(float *dlogits, const float *probs,
						    const int32_t *targets, int N, int V, int Vp,
						    float dloss)
{
	size_t n = (size_t)N * Vp;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
	     idx += (size_t)gridDim.x * blockDim.x) {
		int j = (int)(idx % Vp), i = (int)(idx / Vp);
		float p = probs[idx];
		dlogits[idx] = j >= V ? 0.0f : j == targets[i] ? (p - 1.0f) * dloss : p * dloss;
	}
}

void crossentropy_forward_cuda(const struct sl_gpu *g, float *probs, float *losses,
			       const float *logits, const int32_t *targets, int N, int V, int Vp,
			       int accumulate)
{
	if (N > 0)
		SL_LAUNCH(crossentropy_forward_kernel, sl_blocks(N, 1, 65535), XENT_THREADS, 0,
			  sl_stream(g), probs, losses, logits, targets, N, V, Vp, accumulate);
}

void crossentropy_backward_cuda(const struct sl_gpu *g, float *dlogits, const float *probs,
				const int32_t *targets, int N, int V, int Vp, float dloss)
{
	size_t n = (size_t)N * Vp;
	if (n)
		SL_LAUNCH(crossentropy_backward_kernel, sl_blocks(n, 256, 65535), 256, 0,
			  sl_stream(g), dlogits, probs, targets, N, V, Vp, dloss);
}
