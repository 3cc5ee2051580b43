/* Private to the kernels: the attention of one query, shared by attention_forward (training,
 * over the sequence's own positions) and attention_decode (generation, over a key/value
 * cache), so that both compute a row the same way. */
#ifndef SL_KERNELS_ATTEND_H
#define SL_KERNELS_ATTEND_H
#include <math.h>
#include <stddef.h>
#include "vexpf.h"

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(SL_ATTEND_GENERIC)
typedef float attend_vec __attribute__((vector_size(64), aligned(4), may_alias));

/* attend() for hs = 16 H (H <= 8: every GPT-2 size, tiny and micro), the same operations in the
 * same order (the generic loop's, as GCC vectorises it with AVX-512: a key's 16 lanes each an
 * FMA chain over the H vectors, then summed lane 0 to 15 from 0, then scaled; o's lanes FMA
 * chains over j), so the same bits, with the work arranged for the registers: four keys' lane
 * sums side by side (one key's 16 dependent adds left the core waiting), o held in H vector
 * registers over j (kept in memory, each j waited on the last one's stores): attention_forward
 * 2 x faster on Zen 4 (B = 4, T = 1024: 309 -> 156 ms on 2 cores). Sixteen keys' lane sums at
 * once by a transpose (vector adds in the same order) were slower with GCC 12's shuffles.
 * SL_ATTEND_GENERIC builds the loop alone (tests/test_kernels.py compares the bits). */
static inline __attribute__((always_inline)) float
attend_lanes(attend_vec s)
{
	float d = 0.0f;
	for (int l = 0; l < 16; l++)
		d += s[l];
	return d;
}

static inline __attribute__((always_inline)) void
attend_vectors(float *o, float *pre, float *a, const float *q, const float *k, const float *v,
	       size_t stride, int n, const int H, float scale)
{
	attend_vec qv[8];
	for (int h = 0; h < H; h++)
		qv[h] = *(const attend_vec *)(q + 16 * h);
	float mx = -INFINITY;
	int j = 0;
	for (; j + 4 <= n; j += 4) {
		attend_vec s[4] = { { 0 } };
		for (int t = 0; t < 4; t++)
			for (int h = 0; h < H; h++)
				s[t] += qv[h] * *(const attend_vec *)(k + (size_t)(j + t) * stride + 16 * h);
		for (int t = 0; t < 4; t++) {
			float dot = attend_lanes(s[t]) * scale;
			pre[j + t] = dot;
			if (dot > mx)
				mx = dot;
		}
	}
	for (; j < n; j++) {
		attend_vec s = { 0 };
		for (int h = 0; h < H; h++)
			s += qv[h] * *(const attend_vec *)(k + (size_t)j * stride + 16 * h);
		float dot = attend_lanes(s) * scale;
		pre[j] = dot;
		if (dot > mx)
			mx = dot;
	}
	float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
	for (int i = 0; i < n; i++) {
		float e = vexpf(pre[i] - mx);
		a[i] = e;
		sum += e;
	}
	float inv = 1.0f / sum;
#pragma omp simd
	for (int i = 0; i < n; i++)
		a[i] *= inv;
	attend_vec acc[8] = { { 0 } };
	for (j = 0; j < n; j++) {
		const float w = a[j];
		for (int h = 0; h < H; h++)
			acc[h] += w * *(const attend_vec *)(v + (size_t)j * stride + 16 * h);
	}
	for (int h = 0; h < H; h++)
		*(attend_vec *)(o + 16 * h) = acc[h];
}
#endif

/* One head of one query q (hs) against n keys k[j] and values v[j] (hs floats each, j-th at
 * j * stride): pre (n) = q . k[j] * scale, a (n) = softmax(pre), o (hs) = sum_j a[j] v[j].
 * pre and a may be the same buffer (the scores are then overwritten by the weights). */
static inline void attend(float *o, float *pre, float *a, const float *q, const float *k,
			  const float *v, size_t stride, int n, int hs, float scale)
{
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(SL_ATTEND_GENERIC)
	switch (hs) {
	case 16: attend_vectors(o, pre, a, q, k, v, stride, n, 1, scale); return;
	case 32: attend_vectors(o, pre, a, q, k, v, stride, n, 2, scale); return;
	case 64: attend_vectors(o, pre, a, q, k, v, stride, n, 4, scale); return;
	case 128: attend_vectors(o, pre, a, q, k, v, stride, n, 8, scale); return;
	}
#endif
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
