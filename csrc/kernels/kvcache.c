/* Generation with a key/value cache: each layer keeps the keys and values of the positions
 * already processed, so that a new position costs one row of every layer, not the prefix.
 *
 * Cache layout, per layer: kcache, vcache (B,NH,maxT,hs), hs = C/NH. For one (b, head) the
 * keys of positions 0..t are one contiguous run of (t+1)*hs floats, which the attention of a
 * query streams from start to end (in qkv (B,T,3C) consecutive keys of a head are 3C floats
 * apart); appending a position writes NH runs of hs floats. */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"

// kcache, vcache (B,NH,maxT,hs): positions pos..pos+Tn-1 written, the others kept;
// qkv (B,Tn,3C) = [q | k | v] of the new positions
void kv_append(float *kcache, float *vcache, const float *qkv, int B, int Tn, int C, int NH,
	       int maxT, int pos)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
#pragma omp parallel for collapse(2) schedule(static) if ((size_t)B * Tn * C > 65536)
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < NH; h++) {
			for (int i = 0; i < Tn; i++) {
				const float *src = qkv + ((size_t)b * Tn + i) * C3 + h * hs;
				size_t dst = (((size_t)b * NH + h) * maxT + pos + i) * hs;
				memcpy(kcache + dst, src + C, hs * sizeof(float));
				memcpy(vcache + dst, src + 2 * C, hs * sizeof(float));
			}
		}
	}
}

// out (B,Tn,C); qkv (B,Tn,3C) of the new positions (only q is read);
// kcache, vcache (B,NH,maxT,hs): positions 0..pos+Tn-1 read
void attention_decode(float *out, const float *qkv, const float *kcache, const float *vcache,
		      int B, int Tn, int C, int NH, int maxT, int pos)
{
	const int C3 = 3 * C;
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);

#pragma omp parallel
	{
		/* the scores, then the weights, of one query: pos + Tn positions at the most */
		float *a = malloc((size_t)(pos + Tn) * sizeof *a);
		if (a == NULL) {
			fputs("starpu_llm: attention_decode: out of memory\n", stderr);
			abort();
		}
/* one (b, h, new query i) per iteration: its out slice is its own */
#pragma omp for collapse(3) schedule(static)
		for (int b = 0; b < B; b++) {
			for (int h = 0; h < NH; h++) {
				for (int i = 0; i < Tn; i++) {
					size_t head = ((size_t)b * NH + h) * maxT * hs;
					// causal by construction: query pos+i sees cached keys 0..pos+i
					attend(out + ((size_t)b * Tn + i) * C + h * hs, a, a,
					       qkv + ((size_t)b * Tn + i) * C3 + h * hs, kcache + head,
					       vcache + head, hs, pos + i + 1, hs, scale);
				}
			}
		}
		free(a);
	}
}
