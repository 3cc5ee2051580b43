/* Private to the kernels: the attention of one query, shared by attention_forward (training,
 * over the sequence's own positions) and attention_decode (generation, over a key/value
 * cache), so that both compute a row the same way. */
#ifndef SL_KERNELS_ATTEND_H
#define SL_KERNELS_ATTEND_H
#include <math.h>
#include <stddef.h>
#include "vexpf.h"

/* a (n) = softmax(pre) given mx = max(pre): shifted by the max so that expf never
 * overflows; pre and a may be the same buffer */
static inline __attribute__((always_inline)) void
attend_softmax(float *a, const float *pre, int n, float mx)
{
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
}

/* The vector paths (here and in attention.c's backward): W-float vectors, W = 16 with AVX-512,
 * 8 with AVX2 and FMA (what GCC vectorises the generic loops with); SL_ATTEND_GENERIC, or
 * neither, builds the loops alone. */
#if defined(__GNUC__) && !defined(SL_ATTEND_GENERIC) &&                                       \
	(defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#define SL_ATTEND_VECTORS 1
#ifdef __AVX512F__
#define SL_ATTEND_W 16
#else
#define SL_ATTEND_W 8
#endif
typedef float attend_vec __attribute__((vector_size(SL_ATTEND_W * 4), aligned(4), may_alias));

/* attend() for hs = W H (H = 1, 2, 4, 8: every GPT-2 size, tiny and micro), the same
 * operations in the same order (the generic loop's, as GCC vectorises it: a key's W lanes each
 * an FMA chain over the H vectors, then summed lane 0 to W - 1 from 0, then scaled; o's lanes
 * FMA chains over j), so the same bits, with the work arranged for the registers: four keys'
 * lane sums side by side (one key's W dependent adds left the core waiting), o held in H vector
 * registers over j (kept in memory, each j waited on the last one's stores): attention_forward
 * 2 x faster on Zen 4 (B = 4, T = 1024: 309 -> 156 ms on 2 cores). Sixteen keys' lane sums at
 * once by a transpose (vector adds in the same order) were slower with GCC 12's shuffles.
 * tests/test_kernels.py builds both ways, for AVX-512 and AVX2, and compares the bits. */
static inline __attribute__((always_inline)) attend_vec
attend_load(const float *p)
{
	return *(const attend_vec *)p;
}

/* The vectors H of a head of hs floats that the paths take (1, 2, 4 or 8), else 0 */
static inline int attend_vectors_of(int hs)
{
	const int H = hs % SL_ATTEND_W ? 0 : hs / SL_ATTEND_W;
	return H == 1 || H == 2 || H == 4 || H == 8 ? H : 0;
}

static inline __attribute__((always_inline)) float
attend_lanes(attend_vec s)
{
	float d = 0.0f;
	for (int l = 0; l < SL_ATTEND_W; l++)
		d += s[l];
	return d;
}

static inline __attribute__((always_inline)) void
attend_vectors(float *o, float *pre, float *a, const float *q, const float *k, const float *v,
	       size_t stride, int n, const int H, float scale)
{
	attend_vec qv[8];
	for (int h = 0; h < H; h++)
		qv[h] = attend_load(q + SL_ATTEND_W * h);
	float mx = -INFINITY;
	int j = 0;
	for (; j + 4 <= n; j += 4) {
		attend_vec s[4] = { { 0 } };
		for (int t = 0; t < 4; t++) {
			const float *kj = k + (size_t)(j + t) * stride;
			for (int h = 0; h < H; h++)
				s[t] += qv[h] * attend_load(kj + SL_ATTEND_W * h);
		}
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
			s += qv[h] * attend_load(k + (size_t)j * stride + SL_ATTEND_W * h);
		float dot = attend_lanes(s) * scale;
		pre[j] = dot;
		if (dot > mx)
			mx = dot;
	}
	attend_softmax(a, pre, n, mx);
	attend_vec acc[8] = { { 0 } };
	for (j = 0; j < n; j++) {
		const float w = a[j];
		for (int h = 0; h < H; h++)
			acc[h] += w * attend_load(v + (size_t)j * stride + SL_ATTEND_W * h);
	}
	for (int h = 0; h < H; h++)
		*(attend_vec *)(o + SL_ATTEND_W * h) = acc[h];
}
#endif

/* One head of one query q (hs) against n keys k[j] and values v[j] (hs floats each, j-th at
 * j * stride): pre (n) = q . k[j] * scale, a (n) = softmax(pre), o (hs) = sum_j a[j] v[j].
 * pre and a may be the same buffer (the scores are then overwritten by the weights). */
static inline void attend(float *o, float *pre, float *a, const float *q, const float *k,
			  const float *v, size_t stride, int n, int hs, float scale)
{
#ifdef SL_ATTEND_VECTORS
	switch (attend_vectors_of(hs)) {
	case 1: attend_vectors(o, pre, a, q, k, v, stride, n, 1, scale); return;
	case 2: attend_vectors(o, pre, a, q, k, v, stride, n, 2, scale); return;
	case 4: attend_vectors(o, pre, a, q, k, v, stride, n, 4, scale); return;
	case 8: attend_vectors(o, pre, a, q, k, v, stride, n, 8, scale); return;
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
	attend_softmax(a, pre, n, mx);
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
