/* Generation with a key/value cache: each layer keeps the keys and values of the positions
 * already processed, so that a new position costs one row of every layer, not the prefix.
 *
 * The cache is a set of slots, one per sequence being generated, allocated once and reused by
 * the sequences that come and go (serving, flow/batch.py). Cache layout, per layer: kcache,
 * vcache (S,NH,Tc,hs), hs = C/NH, Tc the positions a slot holds. For one (slot, head) the
 * keys of positions 0..t are one contiguous run of (t+1)*hs floats, which the attention of a
 * query streams from start to end (in qkv (N,3C) consecutive keys of a head are 3C floats
 * apart); appending a position writes NH runs of hs floats.
 *
 * A step takes N rows, each one new position of one sequence, described by idx (N,3) int32:
 * (token, slot, position). Rows of different sequences sit side by side at their own
 * positions, and a sequence may bring several rows (a prompt, prefilled in one step). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"

// kcache, vcache (S,NH,Tc,hs): position idx[r].position of slot idx[r].slot written for each
// row r, the others kept; qkv (N,3C) = [q | k | v] of the rows; idx (N,3)
void kv_append(float *kcache, float *vcache, const float *qkv, const int32_t *idx, int N, int C,
	       int NH, int Tc)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
#pragma omp parallel for collapse(2) schedule(static) if ((size_t)N * C > 65536)
	for (int r = 0; r < N; r++) {
		for (int h = 0; h < NH; h++) {
			const float *src = qkv + (size_t)r * C3 + h * hs;
			size_t dst = (((size_t)idx[3 * r + 1] * NH + h) * Tc + idx[3 * r + 2]) * hs;
			memcpy(kcache + dst, src + C, hs * sizeof(float));
			memcpy(vcache + dst, src + 2 * C, hs * sizeof(float));
		}
	}
}

// out (N,C); qkv (N,3C) of the rows (only q is read); kcache, vcache (S,NH,Tc,hs): row r reads
// positions 0..idx[r].position of its slot; idx (N,3)
void attention_decode(float *out, const float *qkv, const float *kcache, const float *vcache,
		      const int32_t *idx, int N, int C, int NH, int Tc)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);
	int longest = 0;
	if (N < 1)
		return;
	for (int r = 0; r < N; r++)
		if (idx[3 * r + 2] + 1 > longest)
			longest = idx[3 * r + 2] + 1;

/* a few short rows (decoding one sequence) on this thread: a team's start would cost more */
#pragma omp parallel if ((size_t)N * NH * longest * hs > 65536)
	{
		/* the scores, then the weights, of one query */
		float *a = malloc((size_t)longest * sizeof *a);
		if (a == NULL) {
			fputs("starpu_llm: attention_decode: out of memory\n", stderr);
			abort();
		}
/* one (row, head) per iteration: its out slice is its own, computed by one thread whatever
 * the team (dynamic: the rows' positions, hence their costs, differ) */
#pragma omp for collapse(2) schedule(dynamic, 4)
		for (int r = 0; r < N; r++) {
			for (int h = 0; h < NH; h++) {
				const int32_t *x = idx + 3 * r;
				size_t head = ((size_t)x[1] * NH + h) * Tc * hs;
				// causal by construction: the query at position p sees cached keys 0..p
				attend(out + (size_t)r * C + h * hs, a, a, qkv + (size_t)r * C3 + h * hs,
				       kcache + head, vcache + head, hs, x[2] + 1, hs, scale);
			}
		}
		free(a);
	}
}
