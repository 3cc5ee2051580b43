/* Causal multi-head self-attention (no projections: those are matmuls). */
#include "kernels.h"
#include <math.h>
#include "attend.h"

// out (B,T,C), att (B,NH,T,T), qkv (B,T,3C) = [q | k | v] per token
void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
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
				float *a = att + (((size_t)b * NH + h) * T + t) * T;
				// causal: query t sees keys t2 <= t; the scores are overwritten by
				// their softmax (no backward reads them)
				attend(out + ((size_t)b * T + t) * C + h * hs, a, a,
				       head + (size_t)t * C3, head + C, head + 2 * C, C3, t + 1, hs,
				       scale);
				/* the masked triangle is written 0 for the CUDA body of
				 * attention_backward, whose GEMMs read the whole (T, T) att
				 * (the codelet's buffers are shared by its CPU and CUDA bodies) */
				for (int t2 = t + 1; t2 < T; t2++)
					a[t2] = 0.0f;
			}
		}
	}
}

#ifdef SL_ATTEND_VECTORS
/* One query's two loops over its keys for hs = W H, as attend_vectors (attend.h) does the
 * forward's: the operations of the generic loops below in their order, so the same bits,
 * four keys' lane sums side by side and dq held in registers over the keys (B = 2, T = 1024,
 * GPT-2's heads on 2 Zen 4 cores: 334-420 -> 199-222 ms). q, dq, dy: the query's (hs); k, v,
 * dk, dv: key 0's, key t2 at t2 * stride; a, da, dp: the row (n). SL_ATTEND_GENERIC builds
 * the loops alone (tests/test_kernels.py compares the bits). */
static inline __attribute__((always_inline)) void
backward_query_datt(float *da, float *dv, const float *v, const float *a, const float *dy,
		    size_t stride, int n, const int H)
{
	attend_vec y[8];
	for (int h = 0; h < H; h++)
		y[h] = attend_load(dy + SL_ATTEND_W * h);
	int t2 = 0;
	for (; t2 + 4 <= n; t2 += 4) {
		attend_vec s[4] = { { 0 } };
		for (int u = 0; u < 4; u++) {
			const float *vj = v + (size_t)(t2 + u) * stride;
			attend_vec *dvj = (attend_vec *)(dv + (size_t)(t2 + u) * stride);
			const float w = a[t2 + u];
			for (int h = 0; h < H; h++) {
				s[u] += y[h] * attend_load(vj + SL_ATTEND_W * h);
				dvj[h] += w * y[h];
			}
		}
		for (int u = 0; u < 4; u++)
			da[t2 + u] = attend_lanes(s[u]);
	}
	for (; t2 < n; t2++) {
		const float *vj = v + (size_t)t2 * stride;
		attend_vec *dvj = (attend_vec *)(dv + (size_t)t2 * stride);
		attend_vec s = { 0 };
		for (int h = 0; h < H; h++) {
			s += y[h] * attend_load(vj + SL_ATTEND_W * h);
			dvj[h] += a[t2] * y[h];
		}
		da[t2] = attend_lanes(s);
	}
}

static inline __attribute__((always_inline)) void
backward_query_dqk(float *dq, float *dk, const float *k, const float *q, const float *dp,
		   size_t stride, int n, float scale, const int H)
{
	attend_vec x[8], acc[8];
	for (int h = 0; h < H; h++) {
		x[h] = attend_load(q + SL_ATTEND_W * h);
		acc[h] = attend_load(dq + SL_ATTEND_W * h);
	}
	for (int t2 = 0; t2 < n; t2++) {
		const float g = scale * dp[t2];
		const float *kj = k + (size_t)t2 * stride;
		attend_vec *dkj = (attend_vec *)(dk + (size_t)t2 * stride);
		for (int h = 0; h < H; h++) {
			acc[h] += g * attend_load(kj + SL_ATTEND_W * h);
			dkj[h] += g * x[h];
		}
	}
	for (int h = 0; h < H; h++)
		*(attend_vec *)(dq + SL_ATTEND_W * h) = acc[h];
}
#endif

/* The query's first loop (datt, dv) by backward_query_datt where hs allows: 1 if done. */
static int backward_datt_vectors(float *da, float *dv, const float *v, const float *a,
				 const float *dy, size_t stride, int n, int hs)
{
#ifdef SL_ATTEND_VECTORS
	switch (attend_vectors_of(hs)) {
	case 1: backward_query_datt(da, dv, v, a, dy, stride, n, 1); return 1;
	case 2: backward_query_datt(da, dv, v, a, dy, stride, n, 2); return 1;
	case 4: backward_query_datt(da, dv, v, a, dy, stride, n, 4); return 1;
	case 8: backward_query_datt(da, dv, v, a, dy, stride, n, 8); return 1;
	}
#else
	(void)da, (void)dv, (void)v, (void)a, (void)dy, (void)stride, (void)n, (void)hs;
#endif
	return 0;
}

/* The query's last loop (dq, dk) by backward_query_dqk where hs allows: 1 if done. */
static int backward_dqk_vectors(float *dq, float *dk, const float *k, const float *q,
				const float *dp, size_t stride, int n, float scale, int hs)
{
#ifdef SL_ATTEND_VECTORS
	switch (attend_vectors_of(hs)) {
	case 1: backward_query_dqk(dq, dk, k, q, dp, stride, n, scale, 1); return 1;
	case 2: backward_query_dqk(dq, dk, k, q, dp, stride, n, scale, 2); return 1;
	case 4: backward_query_dqk(dq, dk, k, q, dp, stride, n, scale, 4); return 1;
	case 8: backward_query_dqk(dq, dk, k, q, dp, stride, n, scale, 8); return 1;
	}
#else
	(void)dq, (void)dk, (void)k, (void)q, (void)dp, (void)stride, (void)n, (void)scale,
		(void)hs;
#endif
	return 0;
}

// dqkv (B,T,3C) =, dpreatt (B,NH,T,T) scratch, datt (B,NH,T,T) scratch, dout (B,T,C),
// qkv (B,T,3C), att (B,NH,T,T)
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

				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				float *dhead = dqkv + (size_t)b * T * C3 + h * hs;
				// out = att @ v:  datt[t2] = dy . v[t2],  dv[t2] += att[t2] * dy
				int vectors = backward_datt_vectors(da, dhead + 2 * C, head + 2 * C,
								    a, dy, C3, t + 1, hs);
				for (int t2 = 0; !vectors && t2 <= t; t2++) {
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
				// (beyond t: scratch that nothing reads, left as it is)
				// preatt = scale * q . k[t2]:  dq += scale dp k[t2],  dk[t2] +=
				// scale dp q
				if (backward_dqk_vectors(dq, dhead + C, head + C, q, dp, C3, t + 1,
							 scale, hs))
					continue;
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
