/* Causal multi-head self-attention (no projections: those are matmuls). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include "attend.h"

// out (B,T,C), preatt (B,NH,T,T), att (B,NH,T,T), qkv (B,T,3C) = [q | k | v] per token
void attention_forward(float *out, float *preatt, float *att, const float *qkv, int B, int T, int C,
		       int NH)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);

/* one (b, h, query t) per iteration: its att row and its out slice are its own */
#pragma omp parallel for collapse(3) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int t = 0; t < T; t++) {
				// q, k, v of this head at position 0; position t2 is t2 * 3C further
				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				float *pre = preatt + (((size_t)b * NH + h) * T + t) * T;
				float *a = att + (((size_t)b * NH + h) * T + t) * T;
				// causal: query t sees keys t2 <= t
				attend(out + ((size_t)b * T + t) * C + h * hs, pre, a,
				       head + (size_t)t * C3, head + C, head + 2 * C, C3, t + 1, hs,
				       scale);
				for (int t2 = t + 1; t2 < T; t2++) {
					pre[t2] = 0.0f;
					a[t2] = 0.0f;
				}
			}
		}
	}
}

// dqkv (B,T,3C) =, dpreatt (B,NH,T,T) =, datt (B,NH,T,T) =, dout (B,T,C), qkv (B,T,3C),
// att (B,NH,T,T)
void attention_backward(float *dqkv, float *dpreatt, float *datt, const float *dout,
			const float *qkv, const float *att, int B, int T, int C, int NH)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);

/* one (b, h) per iteration: dk and dv of a key get contributions from every later query,
 * so queries of one head are not split across threads; heads write disjoint slices. */
#pragma omp parallel for collapse(2) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int t = 0; t < T; t++) {
				float *d = dqkv + ((size_t)b * T + t) * C3 + h * hs;
#pragma omp simd
				for (int i = 0; i < hs; i++) {
					d[i] = 0.0f;	     // dq
					d[C + i] = 0.0f;     // dk
					d[2 * C + i] = 0.0f; // dv
				}
			}
			for (int t = 0; t < T; t++) {
				const float *a = att + (((size_t)b * NH + h) * T + t) * T;
				float *da = datt + (((size_t)b * NH + h) * T + t) * T;
				float *dp = dpreatt + (((size_t)b * NH + h) * T + t) * T;
				const float *q = qkv + ((size_t)b * T + t) * C3 + h * hs;
				float *dq = dqkv + ((size_t)b * T + t) * C3 + h * hs;
				const float *dy = dout + ((size_t)b * T + t) * C + h * hs;

				// out = att @ v:  datt[t2] = dy . v[t2],  dv[t2] += att[t2] * dy
				for (int t2 = 0; t2 <= t; t2++) {
					const float *v =
						qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
					float *dv =
						dqkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
					float w = a[t2];
					float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
					for (int i = 0; i < hs; i++) {
						dot += dy[i] * v[i];
						dv[i] += w * dy[i];
					}
					da[t2] = dot;
				}
				// softmax: dpreatt = att * (datt - sum(att * datt))
				float s = 0.0f;
#pragma omp simd reduction(+ : s)
				for (int t2 = 0; t2 <= t; t2++)
					s += a[t2] * da[t2];
#pragma omp simd
				for (int t2 = 0; t2 <= t; t2++)
					dp[t2] = a[t2] * (da[t2] - s);
				for (int t2 = t + 1; t2 < T; t2++) {
					da[t2] = 0.0f;
					dp[t2] = 0.0f;
				}
				// preatt = scale * q . k[t2]:  dq += scale dp k[t2],  dk[t2] +=
				// scale dp q
				for (int t2 = 0; t2 <= t; t2++) {
					const float *k =
						qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
					float *dk = dqkv + ((size_t)b * T + t2) * C3 + C + h * hs;
					float g = scale * dp[t2];
#pragma omp simd
					for (int i = 0; i < hs; i++) {
						dq[i] += g * k[i];
						dk[i] += g * q[i];
					}
				}
			}
		}
	}
}
