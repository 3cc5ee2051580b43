/* Softmax over the real vocabulary + cross-entropy loss. */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include "vexpf.h"

// probs (N,Vp), losses (N) = or +=, logits (N,Vp), targets (N)
void crossentropy_softmax_forward(float *probs, float *losses, const float *logits,
				  const int32_t *targets, int N, int V, int Vp, int accumulate)
{
#pragma omp parallel for schedule(static)
	for (int i = 0; i < N; i++) {
		const float *x = logits + (size_t)i * Vp;
		float *p = probs + (size_t)i * Vp;
		float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
		for (int j = 0; j < V; j++)
			mx = x[j] > mx ? x[j] : mx;
		/* ~50k terms: the normaliser is summed in double */
		double sum = 0.0;
#pragma omp simd reduction(+ : sum)
		for (int j = 0; j < V; j++) {
			float e = vexpf(x[j] - mx);
			p[j] = e;
			sum += e;
		}
		float inv = (float)(1.0 / sum);
#pragma omp simd
		for (int j = 0; j < V; j++)
			p[j] *= inv;
		for (int j = V; j < Vp; j++)
			p[j] = 0.0f;
		/* -log(softmax[target]) as log(sum) - (x_t - max): accurate even where the float
		 * probability underflows to 0 */
		int tgt = targets[i];
		float loss = (float)(log(sum) - ((double)x[tgt] - (double)mx));
		losses[i] = accumulate ? losses[i] + loss : loss;
	}
}

// dlogits (N,Vp) =, probs (N,Vp), targets (N); dlogits may be probs
void crossentropy_softmax_backward(float *dlogits, const float *probs, const int32_t *targets,
				   int N, int V, int Vp, float dloss)
{
#pragma omp parallel for schedule(static)
	for (int i = 0; i < N; i++) {
		const float *p = probs + (size_t)i * Vp;
		float *d = dlogits + (size_t)i * Vp;
		int tgt = targets[i];
		float pt = p[tgt]; // read before the row is (maybe in place) overwritten
/* element-wise, each element read before it is written: correct when d == p */
#pragma omp simd
		for (int j = 0; j < V; j++)
			d[j] = p[j] * dloss;
		d[tgt] = (pt - 1.0f) * dloss;
		for (int j = V; j < Vp; j++)
			d[j] = 0.0f;
	}
}
