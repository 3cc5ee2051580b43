/* Token + position embedding. */
#include "kernels.h"
#include <limits.h>
#include <omp.h>
#include "parallel.h"

/* Where row v of a matrix in nb row blocks (kernels.h) is: block *b, its row *r. */
static inline void locate_row(const int *rows, int nb, int v, int *b, int *r)
{
	int i = 0;
	while (i < nb - 1 && v >= rows[i])
		v -= rows[i++];
	*b = i;
	*r = v;
}

// out (B,T,C), inp (B,T) int32, wte (Vp,C) in nb row blocks, wpe (maxT,C)
void encoder_forward_blocks(float *out, const int32_t *inp, const float *const *wte,
			    const int *rows, int nb, const float *wpe, int B, int T, int C)
{
#pragma omp parallel for collapse(2) schedule(static)
	for (int b = 0; b < B; b++) {
		for (int t = 0; t < T; t++) {
			int blk, row;
			locate_row(rows, nb, inp[b * T + t], &blk, &row);
			float *out_bt = out + ((size_t)b * T + t) * C;
			const float *wte_ix = wte[blk] + (size_t)row * C;
			const float *wpe_t = wpe + (size_t)t * C;
#pragma omp simd
			for (int c = 0; c < C; c++) {
				out_bt[c] = wte_ix[c] + wpe_t[c];
			}
		}
	}
}

// out (B,T,C), inp (B,T) int32, wte (Vp,C), wpe (maxT,C)
void encoder_forward(float *out, const int32_t *inp, const float *wte, const float *wpe, int B,
		     int T, int C)
{
	const int all = INT_MAX; /* one block: every row is in it, whatever Vp */
	encoder_forward_blocks(out, inp, &wte, &all, 1, wpe, B, T, C);
}

// out (N,C), idx (N,3) int32: (token, slot, position) of each row; wte (Vp,C) in nb row
// blocks, wpe (maxT,C)
void encoder_decode_blocks(float *out, const int32_t *idx, const float *const *wte,
			   const int *rows, int nb, const float *wpe, int N, int C)
{
#pragma omp parallel for schedule(static) if ((size_t)N * C > 65536)
	for (int r = 0; r < N; r++) {
		int blk, row;
		locate_row(rows, nb, idx[3 * r], &blk, &row);
		float *out_r = out + (size_t)r * C;
		const float *wte_ix = wte[blk] + (size_t)row * C;
		const float *wpe_t = wpe + (size_t)idx[3 * r + 2] * C;
#pragma omp simd
		for (int c = 0; c < C; c++) {
			out_r[c] = wte_ix[c] + wpe_t[c];
		}
	}
}

// dwte (Vp,C) += in nb row blocks, dwpe (maxT,C) +=, dout (B,T,C), inp (B,T)
void encoder_backward_blocks(float *const *dwte, const int *rows, int nb, float *dwpe,
			     const float *dout, const int32_t *inp, int B, int T, int C)
{
/* Repeated token ids make a parallel loop over (b,t) race on rows of dwte. Instead every
 * thread owns a contiguous block of channels and walks all (b,t) in order: race-free,
 * deterministic (same summation order for any team size and any row blocks), and the inner
 * loop is a contiguous vectorised run of the channel block. */
#pragma omp parallel
	{
		int c0, c1;
		thread_runs16(C, &c0, &c1);
		for (int b = 0; b < B; b++) {
			for (int t = 0; t < T; t++) {
				int blk, row;
				locate_row(rows, nb, inp[b * T + t], &blk, &row);
				const float *dout_bt = dout + ((size_t)b * T + t) * C;
				float *dwte_ix = dwte[blk] + (size_t)row * C;
				float *dwpe_t = dwpe + (size_t)t * C;
#pragma omp simd
				for (int c = c0; c < c1; c++) {
					dwte_ix[c] += dout_bt[c];
					dwpe_t[c] += dout_bt[c];
				}
			}
		}
	}
}

// dwte (Vp,C) +=, dwpe (maxT,C) +=, dout (B,T,C), inp (B,T)
void encoder_backward(float *dwte, float *dwpe, const float *dout, const int32_t *inp, int B, int T,
		      int C)
{
	const int all = INT_MAX;
	encoder_backward_blocks(&dwte, &all, 1, dwpe, dout, inp, B, T, C);
}
