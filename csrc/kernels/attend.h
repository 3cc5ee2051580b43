/* Private to the kernels: the attention of one query, shared by attention_forward (training,
 * over the sequence's own positions) and attention_decode (generation, over a key/value
 * cache), so that both compute a row the same way. */
#ifndef SL_KERNELS_ATTEND_H
#define SL_KERNELS_ATTEND_H
#include <math.h>
#include <stddef.h>
#include "vexpf.h"

/* One head of one query q (hs) against n keys k[j] and values v[j] (hs floats each, j-th at
 * j * stride): pre (n) = q . k[j] * scale, a (n) = softmax(pre), o (hs) = sum_j a[j] v[j].
 * pre and a may be the same buffer (the scores are then overwritten by the weights). */
static inline void attend(float *o, float *pre, float *a, const float *q, const float *k,
			  const float *v, size_t stride, int n, int hs, float scale)
{
	// scores and their max
	float mx = -INFINITY;
	for (int j = 0; j < n; j++) {
		const float *kj = k + (size_t)j * stride;
		float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
		for (int i = 0; i < hs; i++)
			dot += q[i] * kj[i];
		dot *= scale;
		pre[j] = dot;
		if (dot > mx)
			mx = dot;
	}
	// softmax, shifted by the max so that expf never overflows
	float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
	for (int j = 0; j < n; j++) {
		float e = vexpf(pre[j] - mx);
		a[j] = e;
		sum += e;
	}
	float inv = 1.0f / sum;
#pragma omp simd
	for (int j = 0; j < n; j++)
		a[j] *= inv;
	// o = sum_j a[j] v[j]
#pragma omp simd
	for (int i = 0; i < hs; i++)
		o[i] = 0.0f;
	for (int j = 0; j < n; j++) {
		const float *vj = v + (size_t)j * stride;
		float w = a[j];
#pragma omp simd
		for (int i = 0; i < hs; i++)
			o[i] += w * vj[i];
	}
}
#endif
