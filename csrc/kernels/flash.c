/* Causal multi-head self-attention, fused: the (T, T) scores never stored (--attention flash).
 *
 * FlashAttention (Dao et al. 2022) in FlashAttention-2's loop order, one query row at a time:
 * the row walks its keys in tiles of SL_FLASH_TILE keeping a running max m, the running sum l
 * of exp(score - m) and the unnormalised output o; a tile that raises the max rescales l and o
 * by exp(m_old - m_new) (the same factor on both, so its rounding cancels in o / l). The
 * forward keeps only out and lse = m + log(l) per row; the backward recomputes each weight
 * as exp(score - lse). This is the CPU twin of csrc/cuda/attention.cu's fused kernels (the
 * same tiles in the same order per row): the codelet's CPU body, and the flow run with StarPU
 * on CPUs exactly as on a GPU.
 *
 * Every dot product (q.k, dy.v) is summed one way, flash_dot's: 16 partial sums (element i
 * into partial i mod 16, in order), then a halving tree (partial l + partial l + 8, then + 4,
 * + 2, + 1). The vector paths (16 floats at a time: one AVX-512 register or two AVX2 ones)
 * sum four keys' partials side by side with a few shuffles, where one key's 16 lanes added
 * one after the other cost more than the products; the loops below do the same operations
 * in the same order (tests/test_kernels.py builds both and compares the bits). */
#include "kernels.h"
#include <math.h>
#include "attend.h"

#define FLASH_PARTS 16 /* the partial sums of a dot product */

/* p + x y, one rounding where the machine has fused multiply-adds (every build with the
 * vector paths, whose vector a b + c GCC fuses): said, not left to GCC's contraction, which
 * it skips in a loop it vectorises with masks */
#ifdef __FP_FAST_FMAF
#define FLASH_FMA(x, y, p) fmaf((x), (y), (p))
#else
#define FLASH_FMA(x, y, p) ((p) + (x) * (y))
#endif

/* x . y over n floats, summed as every dot product here is (the header) */
static inline float flash_dot(const float *x, const float *y, int n)
{
	float p[FLASH_PARTS] = { 0 };
	for (int i0 = 0; i0 < n; i0 += FLASH_PARTS)
		for (int l = 0; l < FLASH_PARTS && i0 + l < n; l++)
			p[l] = FLASH_FMA(x[i0 + l], y[i0 + l], p[l]);
	for (int w = FLASH_PARTS / 2; w > 0; w /= 2)
		for (int l = 0; l < w; l++)
			p[l] += p[l + w];
	return p[0];
}

#if defined(SL_ATTEND_VECTORS) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SL_FLASH_VECTORS 1
#endif
#endif

#ifdef SL_FLASH_VECTORS
/* 16 floats: a dot product's partial sums, or 16 of a row's accumulators (GCC splits it in
 * two registers with AVX2) */
typedef float flash_vec __attribute__((vector_size(64), aligned(4), may_alias));
typedef float flash_v8 __attribute__((vector_size(32)));
typedef float flash_v4 __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) flash_vec flash_load(const float *p)
{
	return *(const flash_vec *)p;
}

/* partial l + partial l + 8, then + 4: the tree's first two levels, 4 lanes left */
static inline __attribute__((always_inline)) flash_v4 flash_fold(flash_vec a)
{
	flash_v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
		     __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
	return __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
}

/* the four dot products whose partials are a, b, c, d (flash_dot's tree, side by side) */
static inline __attribute__((always_inline)) flash_v4 flash_sum4(flash_vec a, flash_vec b,
								  flash_vec c, flash_vec d)
{
	flash_v4 x0 = flash_fold(a), x1 = flash_fold(b), x2 = flash_fold(c), x3 = flash_fold(d);
	// + 2: (x_u[0] + x_u[2], x_u[1] + x_u[3]) for u = 0, 1 and for u = 2, 3
	flash_v4 s01 = __builtin_shufflevector(x0, x1, 0, 4, 1, 5) +
		       __builtin_shufflevector(x0, x1, 2, 6, 3, 7);
	flash_v4 s23 = __builtin_shufflevector(x2, x3, 0, 4, 1, 5) +
		       __builtin_shufflevector(x2, x3, 2, 6, 3, 7);
	// + 1
	return __builtin_shufflevector(s01, s23, 0, 1, 4, 5) +
	       __builtin_shufflevector(s01, s23, 2, 3, 6, 7);
}

/* one dot product's (the same tree) */
static inline __attribute__((always_inline)) float flash_sum1(flash_vec a)
{
	flash_v4 x = flash_fold(a);
	return (x[0] + x[2]) + (x[1] + x[3]);
}

/* One query row of the forward over its `keys` keys (key j at k + j stride, its value at
 * v + j stride), hs = 16 H: o (hs) and the row's lse. */
static inline __attribute__((always_inline)) void
flash_query_forward(float *o, float *lse, const float *q, const float *k, const float *v,
		    size_t stride, int keys, float scale, const int H)
{
	flash_vec qv[8], acc[8];
	for (int h = 0; h < H; h++) {
		qv[h] = flash_load(q + FLASH_PARTS * h);
		acc[h] = (flash_vec){ 0 };
	}
	float s[SL_FLASH_TILE];
	float m = -INFINITY, l = 0.0f;
	for (int j0 = 0; j0 < keys; j0 += SL_FLASH_TILE) {
		const int n = keys - j0 < SL_FLASH_TILE ? keys - j0 : SL_FLASH_TILE;
		const float *kt = k + (size_t)j0 * stride, *vt = v + (size_t)j0 * stride;
		float mt = m;
		int j = 0;
		for (; j + 4 <= n; j += 4) {
			flash_vec d[4] = { { 0 } };
			for (int u = 0; u < 4; u++)
				for (int h = 0; h < H; h++)
					d[u] += qv[h] * flash_load(kt + (size_t)(j + u) * stride +
								   FLASH_PARTS * h);
			flash_v4 dots = flash_sum4(d[0], d[1], d[2], d[3]);
			for (int u = 0; u < 4; u++) {
				s[j + u] = dots[u] * scale;
				if (s[j + u] > mt)
					mt = s[j + u];
			}
		}
		for (; j < n; j++) {
			flash_vec d = { 0 };
			for (int h = 0; h < H; h++)
				d += qv[h] * flash_load(kt + (size_t)j * stride + FLASH_PARTS * h);
			s[j] = flash_sum1(d) * scale;
			if (s[j] > mt)
				mt = s[j];
		}
		float corr = j0 == 0 ? 0.0f : vexpf(m - mt);
#pragma omp simd
		for (j = 0; j < n; j++)
			s[j] = vexpf(s[j] - mt);
		float sum = 0.0f;
		for (j = 0; j < n; j++)
			sum += s[j];
		l = l * corr + sum;
		for (int h = 0; h < H; h++)
			acc[h] *= corr;
		for (j = 0; j < n; j++) {
			const float w = s[j];
			for (int h = 0; h < H; h++)
				acc[h] += w * flash_load(vt + (size_t)j * stride + FLASH_PARTS * h);
		}
		m = mt;
	}
	for (int h = 0; h < H; h++)
		*(flash_vec *)(o + FLASH_PARTS * h) = acc[h] / l;
	*lse = m + logf(l);
}

/* The backward's queries of a key go by blocks of FLASH_BLOCK: their dot products four at a
 * time, then the block's exponentials side by side (vexpf's bits are the scalar call's), then
 * the accumulators in query order. */
#define FLASH_BLOCK 16

/* One head's dq, dk and dv, hs = 16 H, in one pass over its (query, key) pairs: key j
 * (outer, ascending) over the queries t >= j that see it, each pair's weight a = exp(scale
 * q_t.k_j - lse_t) and g = scale a (dy_t.v_j - dsum_t) added into dk_j (g q_t), dv_j (a dy_t)
 * and dq_t (g k_j, in memory: every key of the head adds into it, in ascending j). q, dy,
 * dq: query 0's (query t at t qstride, t ystride, t qstride); k, v, dk, dv: key 0's (key j at
 * j qstride); lse, dsum: the head's (T). */
static inline __attribute__((always_inline)) void
flash_head_backward(float *dq, float *dk, float *dv, const float *q, const float *k,
		    const float *v, const float *dy, size_t qstride, size_t ystride,
		    const float *lse, const float *dsum, int T, float scale, const int H)
{
	for (int t = 0; t < T; t++)
		for (int h = 0; h < H; h++)
			*(flash_vec *)(dq + (size_t)t * qstride + FLASH_PARTS * h) = (flash_vec){ 0 };
	for (int j = 0; j < T; j++) {
		flash_vec kv[8], vv[8], dka[8], dva[8];
		for (int h = 0; h < H; h++) {
			kv[h] = flash_load(k + (size_t)j * qstride + FLASH_PARTS * h);
			vv[h] = flash_load(v + (size_t)j * qstride + FLASH_PARTS * h);
			dka[h] = (flash_vec){ 0 };
			dva[h] = (flash_vec){ 0 };
		}
		int t = j;
		for (; t + FLASH_BLOCK <= T; t += FLASH_BLOCK) {
			float x[FLASH_BLOCK], da[FLASH_BLOCK], a[FLASH_BLOCK], g[FLASH_BLOCK];
			for (int c = 0; c < FLASH_BLOCK; c += 4) {
				flash_vec d[4] = { { 0 } }, e[4] = { { 0 } };
				for (int u = 0; u < 4; u++) {
					const float *qt = q + (size_t)(t + c + u) * qstride;
					const float *yt = dy + (size_t)(t + c + u) * ystride;
					for (int h = 0; h < H; h++) {
						d[u] += flash_load(qt + FLASH_PARTS * h) * kv[h];
						e[u] += flash_load(yt + FLASH_PARTS * h) * vv[h];
					}
				}
				flash_v4 dots = flash_sum4(d[0], d[1], d[2], d[3]);
				flash_v4 das = flash_sum4(e[0], e[1], e[2], e[3]);
				for (int u = 0; u < 4; u++) {
					x[c + u] = dots[u] * scale - lse[t + c + u];
					da[c + u] = das[u];
				}
			}
#pragma omp simd
			for (int c = 0; c < FLASH_BLOCK; c++) {
				a[c] = vexpf(x[c]);
				g[c] = scale * (a[c] * (da[c] - dsum[t + c]));
			}
			for (int c = 0; c < FLASH_BLOCK; c++) {
				const float *qt = q + (size_t)(t + c) * qstride;
				const float *yt = dy + (size_t)(t + c) * ystride;
				flash_vec *dqt = (flash_vec *)(dq + (size_t)(t + c) * qstride);
				for (int h = 0; h < H; h++) {
					dka[h] += g[c] * flash_load(qt + FLASH_PARTS * h);
					dva[h] += a[c] * flash_load(yt + FLASH_PARTS * h);
					dqt[h] += g[c] * kv[h];
				}
			}
		}
		for (; t < T; t++) {
			const float *qt = q + (size_t)t * qstride, *yt = dy + (size_t)t * ystride;
			flash_vec *dqt = (flash_vec *)(dq + (size_t)t * qstride);
			flash_vec d = { 0 }, e = { 0 };
			for (int h = 0; h < H; h++) {
				d += flash_load(qt + FLASH_PARTS * h) * kv[h];
				e += flash_load(yt + FLASH_PARTS * h) * vv[h];
			}
			const float a = vexpf(flash_sum1(d) * scale - lse[t]);
			const float g = scale * (a * (flash_sum1(e) - dsum[t]));
			for (int h = 0; h < H; h++) {
				dka[h] += g * flash_load(qt + FLASH_PARTS * h);
				dva[h] += a * flash_load(yt + FLASH_PARTS * h);
				dqt[h] += g * kv[h];
			}
		}
		for (int h = 0; h < H; h++) {
			*(flash_vec *)(dk + (size_t)j * qstride + FLASH_PARTS * h) = dka[h];
			*(flash_vec *)(dv + (size_t)j * qstride + FLASH_PARTS * h) = dva[h];
		}
	}
}
#endif

/* The 16-float vectors H of a head of hs floats that the vector paths take (1, 2, 4 or 8:
 * GPT-2's 64 and the test models' 16 to 128), else 0 (and in a build without them) */
static int flash_vectors_of(int hs)
{
#ifdef SL_FLASH_VECTORS
	const int H = hs % FLASH_PARTS ? 0 : hs / FLASH_PARTS;
	return H == 1 || H == 2 || H == 4 || H == 8 ? H : 0;
#else
	(void)hs;
	return 0;
#endif
}

/* A row of the forward by flash_query_forward (H = flash_vectors_of(hs) > 0) */
static void flash_forward_vectors(float *o, float *lse, const float *q, const float *k,
				  const float *v, size_t stride, int keys, float scale, int H)
{
#ifdef SL_FLASH_VECTORS
	switch (H) {
	case 1: flash_query_forward(o, lse, q, k, v, stride, keys, scale, 1); break;
	case 2: flash_query_forward(o, lse, q, k, v, stride, keys, scale, 2); break;
	case 4: flash_query_forward(o, lse, q, k, v, stride, keys, scale, 4); break;
	case 8: flash_query_forward(o, lse, q, k, v, stride, keys, scale, 8); break;
	}
#else
	(void)o, (void)lse, (void)q, (void)k, (void)v, (void)stride, (void)keys, (void)scale,
		(void)H;
#endif
}

/* A head's backward by flash_head_backward (H = flash_vectors_of(hs) > 0) */
static void flash_head_vectors(float *dq, float *dk, float *dv, const float *q, const float *k,
			       const float *v, const float *dy, size_t qstride, size_t ystride,
			       const float *lse, const float *dsum, int T, float scale, int H)
{
#ifdef SL_FLASH_VECTORS
	switch (H) {
	case 1: flash_head_backward(dq, dk, dv, q, k, v, dy, qstride, ystride, lse, dsum, T, scale, 1); break;
	case 2: flash_head_backward(dq, dk, dv, q, k, v, dy, qstride, ystride, lse, dsum, T, scale, 2); break;
	case 4: flash_head_backward(dq, dk, dv, q, k, v, dy, qstride, ystride, lse, dsum, T, scale, 4); break;
	case 8: flash_head_backward(dq, dk, dv, q, k, v, dy, qstride, ystride, lse, dsum, T, scale, 8); break;
	}
#else
	(void)dq, (void)dk, (void)dv, (void)q, (void)k, (void)v, (void)dy, (void)qstride,
		(void)ystride, (void)lse, (void)dsum, (void)T, (void)scale, (void)H;
#endif
}

// out (B,T,C), lse (B,NH,T), qkv (B,T,3C) = [q | k | v] per token
void attention_flash_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
			     int NH)
{
	const int C3 = 3 * C, hs = C / NH, H = flash_vectors_of(hs);
	const float scale = 1.0f / sqrtf((float)hs);

#pragma omp parallel for collapse(3) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int t = 0; t < T; t++) {
				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				const float *q = head + (size_t)t * C3;
				float *o = out + ((size_t)b * T + t) * C + h * hs;
				float *lt = lse + ((size_t)b * NH + h) * T + t;
				if (H) {
					flash_forward_vectors(o, lt, q, head + C, head + 2 * C, C3,
							      t + 1, scale, H);
					continue;
				}
				float s[SL_FLASH_TILE];
				float m = -INFINITY, l = 0.0f;
				for (int i = 0; i < hs; i++)
					o[i] = 0.0f;
				// causal: the tiles of keys 0..t
				for (int j0 = 0; j0 <= t; j0 += SL_FLASH_TILE) {
					int n = t + 1 - j0 < SL_FLASH_TILE ? t + 1 - j0 : SL_FLASH_TILE;
					float mt = m;
					for (int j = 0; j < n; j++) {
						const float *k = head + C + (size_t)(j0 + j) * C3;
						s[j] = flash_dot(q, k, hs) * scale;
						if (s[j] > mt)
							mt = s[j];
					}
					float corr = j0 == 0 ? 0.0f : vexpf(m - mt);
#pragma omp simd
					for (int j = 0; j < n; j++)
						s[j] = vexpf(s[j] - mt);
					float sum = 0.0f;
					for (int j = 0; j < n; j++)
						sum += s[j];
					l = l * corr + sum;
#pragma omp simd
					for (int i = 0; i < hs; i++)
						o[i] *= corr;
					for (int j = 0; j < n; j++) {
						const float *v = head + 2 * C + (size_t)(j0 + j) * C3;
						float w = s[j];
#pragma omp simd
						for (int i = 0; i < hs; i++)
							o[i] += w * v[i];
					}
					m = mt;
				}
				for (int i = 0; i < hs; i++)
					o[i] /= l;
				*lt = m + logf(l);
			}
		}
	}
}

// dqkv (B,T,3C) =, dsum (B,NH,T) scratch, dout (B,T,C), qkv (B,T,3C), out (B,T,C), lse (B,NH,T)
void attention_flash_backward(float *dqkv, float *dsum, const float *dout, const float *qkv,
			      const float *out, const float *lse, int B, int T, int C, int NH)
{
	const int C3 = 3 * C, hs = C / NH, H = flash_vectors_of(hs);
	const float scale = 1.0f / sqrtf((float)hs);

	/* dsum[t] = dy_t . out_t = sum_j att[t][j] (dy_t . v_j): the softmax backward's row sum,
	 * from out instead of the weights */
#pragma omp parallel for collapse(3) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int t = 0; t < T; t++) {
				const size_t at = ((size_t)b * T + t) * C + h * hs;
				dsum[((size_t)b * NH + h) * T + t] = flash_dot(dout + at, out + at, hs);
			}
		}
	}
	/* Weight a = exp(s - lse), da = dy_t . v_j, ds = a (da - dsum_t); dq_t += scale ds k_j,
	 * dk_j += scale ds q_t, dv_j += a dy_t. With the vector paths one pass a head
	 * (flash_head_backward: five products a pair, a thread a head); else two passes that each own what they write, so that no two threads add into one row
	 * (deterministic, no atomics): dq per query over its keys, then dk and dv per key over its
	 * queries t >= j (seven products a pair: the scores and dy.v recomputed in both). Each
	 * pair's a and g are the same operations every way, and dq_t, dk_j, dv_j get their terms
	 * in the same order (ascending j, ascending t): the same bits. */
	if (H) {
#pragma omp parallel for collapse(2) schedule(static)
		for (int b = 0; b < B; b++) {
			for (int h = 0; h < NH; h++) {
				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				float *dhead = dqkv + (size_t)b * T * C3 + h * hs;
				const size_t row0 = ((size_t)b * NH + h) * T;
				flash_head_vectors(dhead, dhead + C, dhead + 2 * C, head, head + C,
						   head + 2 * C, dout + (size_t)b * T * C + h * hs, C3,
						   C, lse + row0, dsum + row0, T, scale, H);
			}
		}
		return;
	}
#pragma omp parallel for collapse(3) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int t = 0; t < T; t++) {
				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				const float *q = head + (size_t)t * C3;
				const float *dy = dout + ((size_t)b * T + t) * C + h * hs;
				float *dq = dqkv + ((size_t)b * T + t) * C3 + h * hs;
				size_t row = ((size_t)b * NH + h) * T + t;
				const float lt = lse[row], dt = dsum[row];
				for (int i = 0; i < hs; i++)
					dq[i] = 0.0f;
				for (int j = 0; j <= t; j++) {
					const float *k = head + C + (size_t)j * C3;
					const float *v = head + 2 * C + (size_t)j * C3;
					float g = scale * (vexpf(flash_dot(q, k, hs) * scale - lt) *
							   (flash_dot(dy, v, hs) - dt));
#pragma omp simd
					for (int i = 0; i < hs; i++)
						dq[i] += g * k[i];
				}
			}
		}
	}
#pragma omp parallel for collapse(3) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int j = 0; j < T; j++) {
				const float *head = qkv + (size_t)b * T * C3 + h * hs;
				const float *k = head + C + (size_t)j * C3;
				const float *v = head + 2 * C + (size_t)j * C3;
				float *dk = dqkv + ((size_t)b * T + j) * C3 + C + h * hs;
				float *dv = dk + C;
				for (int i = 0; i < hs; i++) {
					dk[i] = 0.0f;
					dv[i] = 0.0f;
				}
				for (int t = j; t < T; t++) {
					const float *q = head + (size_t)t * C3;
					const float *dy = dout + ((size_t)b * T + t) * C + h * hs;
					size_t row = ((size_t)b * NH + h) * T + t;
					float a = vexpf(flash_dot(q, k, hs) * scale - lse[row]);
					float g = scale * (a * (flash_dot(dy, v, hs) - dsum[row]));
#pragma omp simd
					for (int i = 0; i < hs; i++) {
						dk[i] += g * q[i];
						dv[i] += a * dy[i];
					}
				}
			}
		}
	}
}
