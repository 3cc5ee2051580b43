/* Drawing the next tokens of a batch of sequences from their logits (the server's step):
 * softmax(logits / temperature) kept to the top_k largest logits and to the nucleus of
 * top_p, one uniform draw per row. The math is flow/generate.sample's (its docstring is the
 * definition); this is its speed: one row per thread, a row's passes over V in its thread's
 * cache, each pass vectorised or without a branch where it can be (the max, the scaling,
 * the sums, the bins), no full sort (the nucleus is found by binning the tokens by
 * log-probability and sorting the boundary bin alone), the draw's cumulative sum skipping
 * whole blocks of tokens. A sum's order differs from numpy's, by units in the last place. */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vexp.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NUCLEUS_BINS 32			  /* bins a nat of log-probability */
#define NBINS (NUCLEUS_BINS * 64)	  /* beyond 64 nats below the top: the last bin */
#define DRAW_BLOCK 64			  /* the draw's first pass: sums of 64 tokens */

struct scratch {
	double *z, *p; /* (V) log-probabilities up to a constant, probabilities */
	double *sel;   /* (V) top_k's selection */
	int *ids;      /* (V) the boundary bin's tokens */
	int *bins;     /* (V) each token's bin in the first pass */
	double mass[NBINS];
	double part[4][NBINS]; /* the first pass's masses, tokens j mod 4 apart */
};

/* The k-th largest of a (n) (0 < k <= n), a reordered in place: quickselect. */
static double kth_largest(double *a, int n, int k)
{
	int lo = 0, hi = n - 1, want = k - 1; /* position want in decreasing order */
	while (lo < hi) {
		double pivot = a[lo + (hi - lo) / 2];
		int i = lo, j = hi;
		while (i <= j) {
			while (a[i] > pivot)
				i++;
			while (a[j] < pivot)
				j--;
			if (i <= j) {
				double t = a[i];
				a[i] = a[j];
				a[j] = t;
				i++;
				j--;
			}
		}
		if (want <= j)
			hi = j;
		else if (want >= i)
			lo = i;
		else
			return a[want];
	}
	return a[want];
}

/* The boundary bin's order: decreasing probability, ties by id. */
static const double *cmp_p;
#pragma omp threadprivate(cmp_p)
static int by_probability(const void *a, const void *b)
{
	int i = *(const int *)a, j = *(const int *)b;
	if (cmp_p[i] != cmp_p[j])
		return cmp_p[i] > cmp_p[j] ? -1 : 1;
	return (i > j) - (i < j);
}

/* Keeps p (V) to its nucleus (the other entries set to 0): the bins' masses from the top give
 * the bin where the sum reaches top_p; the bins above it are kept whole, those below dropped,
 * and that bin's tokens are binned again, finer, over their own range of z, until few enough
 * are left to sort (or they all have the same probability: then they stay in id order); the
 * sorted ones are kept in decreasing probability, ties by id, until the sum reaches top_p.
 * So a flat row (high temperature, an untrained model: most tokens in one bin of the first
 * pass) costs a few passes over the candidates, not a sort of the vocabulary. */
static void nucleus(struct scratch *s, int V, double top_p)
{
	const double *z = s->z;
	double *p = s->p, *mass = s->mass, before = 0.0;
	int *ids = s->ids, *bins = s->bins, n = 0, edge = 0;
#pragma omp simd
	for (int j = 0; j < V; j++) {
		double b = -z[j] * NUCLEUS_BINS;
		bins[j] = b < NBINS - 1 ? (int)b : NBINS - 1;
	}
	// four partial masses: a flat row puts most tokens in a few bins, and one array's adds
	// to the same bin would wait for each other
	memset(s->part, 0, sizeof s->part);
	int j = 0;
	for (; j + 4 <= V; j += 4)
		for (int q = 0; q < 4; q++)
			s->part[q][bins[j + q]] += p[j + q];
	for (; j < V; j++)
		s->part[0][bins[j]] += p[j];
	for (int b = 0; b < NBINS; b++)
		mass[b] = (s->part[0][b] + s->part[1][b]) + (s->part[2][b] + s->part[3][b]);
	while (edge < NBINS - 1 && before + mass[edge] < top_p)
		before += mass[edge++];
	/* the edge bin's tokens in id order, without a branch (a flat row mispredicts it) */
	j = 0;
#ifdef __AVX512F__
	/* 16 at a time, compressed in a register (a compressing store is slow on Zen 4); the
	 * store may write 15 ints past the last id, into the padding after ids */
	const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
	const __m512i want = _mm512_set1_epi32(edge);
	for (; j + 16 <= V; j += 16) {
		__mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bins + j), want);
		_mm512_storeu_si512(ids + n, _mm512_maskz_compress_epi32(
						     m, _mm512_add_epi32(lane, _mm512_set1_epi32(j))));
		n += __builtin_popcount(m);
	}
#endif
	for (; j < V; j++) {
		ids[n] = j;
		n += bins[j] == edge;
	}
#pragma omp simd
	for (j = 0; j < V; j++)
		p[j] = bins[j] > edge ? 0.0 : p[j];
	int equal = 0;
	for (;;) {
		double hi = -INFINITY, lo = INFINITY;
		for (int i = 0; i < n; i++) {
			hi = z[ids[i]] > hi ? z[ids[i]] : hi;
			lo = z[ids[i]] < lo ? z[ids[i]] : lo;
		}
		equal = !(hi > lo);
		if (n <= 64 || equal || !isfinite(lo))
			break;
		// NBINS bins over [lo, hi], the most likely first; equal z share a bin
		double scale = NBINS / (hi - lo);
		memset(mass, 0, sizeof s->mass);
		for (int i = 0; i < n; i++) {
			int b = (int)((hi - z[ids[i]]) * scale);
			mass[b < NBINS - 1 ? b : NBINS - 1] += p[ids[i]];
		}
		edge = 0;
		while (edge < NBINS - 1 && before + mass[edge] < top_p)
			before += mass[edge++];
		int m = 0;
		for (int i = 0; i < n; i++) {
			int b = (int)((hi - z[ids[i]]) * scale);
			b = b < NBINS - 1 ? b : NBINS - 1;
			if (b == edge)
				ids[m++] = ids[i];
			else if (b > edge)
				p[ids[i]] = 0.0;
		}
		n = m;
	}
	if (!equal) { /* else they are in id order already */
		cmp_p = p;
		qsort(ids, (size_t)n, sizeof *ids, by_probability);
	}
	int count = 0;
	for (double c = before; count < n && c < top_p; count++)
		c += p[ids[count]];
	for (int i = count; i < n; i++)
		p[ids[i]] = 0.0;
}

/* One row: x (V) finite logits (float or double: one of x32, x64), temperature > 0. */
static int64_t sample_row(struct scratch *s, const float *x32, const double *x64, int V,
			  double temperature, int64_t top_k, double top_p, double u)
{
	double *z = s->z, *p = s->p;
	double xmax = -INFINITY;
	// (a max: exact in any order, so vectorised; the row is finite)
	if (x32) {
#pragma omp simd reduction(max : xmax)
		for (int j = 0; j < V; j++) {
			z[j] = (double)x32[j];
			xmax = z[j] > xmax ? z[j] : xmax;
		}
	} else {
#pragma omp simd reduction(max : xmax)
		for (int j = 0; j < V; j++) {
			z[j] = x64[j];
			xmax = z[j] > xmax ? z[j] : xmax;
		}
	}
	// the top_k largest logits, ties by id: those above the k-th largest value, then the
	// first ids equal to it
	double kth = -INFINITY;
	int64_t equal_kept = V;
	if (top_k > 0 && top_k < V) {
		memcpy(s->sel, z, (size_t)V * sizeof *z);
		kth = kth_largest(s->sel, V, (int)top_k);
		int64_t above = 0;
		for (int j = 0; j < V; j++)
			above += z[j] > kth;
		equal_kept = top_k - above;
	}
	if (kth == -INFINITY && temperature == 1.0) { // no top_k, no division (the same bits)
#pragma omp simd
		for (int j = 0; j < V; j++)
			z[j] = z[j] - xmax;
	} else if (kth == -INFINITY) { // no top_k: every token kept
#pragma omp simd
		for (int j = 0; j < V; j++)
			z[j] = (z[j] - xmax) / temperature;
	} else {
		for (int j = 0; j < V; j++) {
			int kept = z[j] > kth || (z[j] == kth && equal_kept-- > 0);
			z[j] = kept ? (z[j] - xmax) / temperature : -INFINITY;
		}
	}
	double sum = 0.0;
#pragma omp simd reduction(+ : sum)
	for (int j = 0; j < V; j++) {
		p[j] = vexp_neg(z[j]);
		sum += p[j];
	}
	// normalised as the definition (w / w.sum()): a row of equal logits keeps the tokens whose
	// rounded cumulative sums stay below top_p, as numpy's (the draw needs no second one)
#pragma omp simd
	for (int j = 0; j < V; j++)
		p[j] /= sum;
	if (top_p < 1.0)
		nucleus(s, V, top_p);
	// Generator.choice's draw: the first token whose cumulative probability passes u of the total
	double total = 0.0;
#pragma omp simd reduction(+ : total)
	for (int j = 0; j < V; j++)
		total += p[j];
	double v = u * total, c = 0.0;
	// whole blocks while the sum stays at most v (a block's sum vectorised), then token by token
	int j = 0;
	for (; j + DRAW_BLOCK <= V; j += DRAW_BLOCK) {
		double b = 0.0;
#pragma omp simd reduction(+ : b)
		for (int i = j; i < j + DRAW_BLOCK; i++)
			b += p[i];
		if (c + b > v)
			break;
		c += b;
	}
	for (; j < V; j++) {
		c += p[j];
		if (c > v && p[j] != 0.0)
			return j;
	}
	for (j = V - 1; j > 0 && p[j] == 0.0; j--) /* u * total rounded up to the total: the last */
		;
	return j;
}

void sample_rows(int64_t *tokens, const float *x32, const double *x64, size_t ld,
		 const int64_t *rows, int n, int V, const double *temperature,
		 const int64_t *top_k, const double *top_p, const double *u, int threads)
{
	if (threads > n)
		threads = n;
	if (threads < 1)
		threads = 1;
#pragma omp parallel num_threads(threads)
	{
		struct scratch *s = malloc(sizeof *s);
		double *buf = malloc((size_t)V * 3 * sizeof(double));
		int *ids = malloc(((size_t)V * 2 + 16) * sizeof(int)); /* ids, 16 of padding, bins */
		int ok = s && buf && ids;
		if (ok) {
			s->z = buf;
			s->p = buf + V;
			s->sel = buf + 2 * (size_t)V;
			s->ids = ids;
			s->bins = ids + V + 16;
		}
#pragma omp for schedule(dynamic, 1)
		for (int i = 0; i < n; i++) {
			size_t off = (size_t)rows[i] * ld;
			tokens[i] = ok ? sample_row(s, x32 ? x32 + off : NULL, x64 ? x64 + off : NULL, V,
						    temperature[i], top_k[i], top_p[i], u[i])
				       : -2;
		}
		free(ids);
		free(buf);
		free(s);
	}
}
