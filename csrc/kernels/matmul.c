/* Fully connected layer: out = inp @ weight^T + bias, via BLAS sgemm; the weight may come in
 * row blocks (the tied lm head's wte, kernels.h). */
#include "kernels.h"
#include "blas.h" /* <cblas.h> (OpenBLAS) or MKL's, chosen by the build */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "parallel.h"

/* A few rows (decoding: one new position of each sequence) make sgemm stream the weight at a
 * fraction of the memory bandwidth (it packs the weight for each call, and its kernels are
 * tuned for many rows). With N <= SL_MATMUL_FEW_ROWS the product is this kernel's instead: the
 * threads split the weight's rows, and each tile of 4 weight rows, read from memory once, is
 * multiplied with every input row from cache (tiles of 4 input rows x 4 weight rows, 16 vector
 * accumulators). Each entry is one fixed sequence of operations, 16 lane sums over k = l mod 16
 * then the lanes added in order and the tail (C mod 16) last, whatever N, the tile, the thread or
 * the team: a row's output does not depend on the other rows of the step (a sequence decoded
 * alone or in a batch gives the same bits). */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

static inline __attribute__((always_inline)) void
matmul_tile(float *out, const float *inp, const float *w, int ni, int nj, int C, int OC)
{
	// out (ni,OC) columns 0..nj-1, inp (ni,C), w (nj,C): ni, nj <= 4 and constants when inlined
	v16 acc[4][4] = { { { 0 } } };
	const int C16 = C & ~15;
	for (int k = 0; k < C16; k += 16) {
		v16 wv[4], xv[4];
		for (int j = 0; j < nj; j++)
			wv[j] = *(const v16 *)(w + (size_t)j * C + k);
		for (int i = 0; i < ni; i++)
			xv[i] = *(const v16 *)(inp + (size_t)i * C + k);
		for (int i = 0; i < ni; i++)
			for (int j = 0; j < nj; j++)
				acc[i][j] += xv[i] * wv[j];
	}
	for (int i = 0; i < ni; i++)
		for (int j = 0; j < nj; j++) {
			float s = 0.0f, t = 0.0f;
			for (int l = 0; l < 16; l++)
				s += acc[i][j][l];
			for (int k = C16; k < C; k++)
				t += inp[(size_t)i * C + k] * w[(size_t)j * C + k];
			out[(size_t)i * OC + j] = s + t;
		}
}

// out (N,OC) columns 0..R-1 = inp (N,C) @ w (R,C)^T. With more than 4 rows (a tile read 2 to
// 4 times) each tile of 4 weight rows is first copied to 64-byte aligned memory of the thread:
// numpy's buffers (glibc's) sit 16 bytes past a cache line, so each 64-byte load of the tile's
// passes would straddle two lines (measured at N = 16 on the 2-core Zen 4: a step's matmuls
// 12 % faster, 50 -> 44 ms). The copy changes no value: the same sums, the same bits.
static void matmul_few_rows(float *out, const float *inp, const float *w, int R, int N, int C,
			    int OC)
{
#pragma omp parallel if ((size_t)R * C > 65536)
	{
		float *tile = N > 4 && (uintptr_t)w % 64 != 0
				      ? aligned_alloc(64, ((size_t)4 * C * sizeof(float) + 63) & ~(size_t)63)
				      : NULL; /* NULL: the tiles read where they are */
#pragma omp for schedule(static)
		for (int j = 0; j < R; j += 4) {
			const float *wj = w + (size_t)j * C;
			float *oj = out + j;
			int i = 0;
			if (R - j >= 4) {
				if (tile != NULL)
					wj = memcpy(tile, wj, (size_t)4 * C * sizeof(float));
				for (; i + 4 <= N; i += 4)
					matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 4, 4, C, OC);
				switch (N - i) {
				case 3: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 3, 4, C, OC); break;
				case 2: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 2, 4, C, OC); break;
				case 1: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 1, 4, C, OC); break;
				}
			} else {	// the last 1..3 weight rows
				for (; i < N; i++)
					matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 1, R - j, C, OC);
			}
		}
		free(tile);
	}
}

// out (N,OC), inp (N,C), weight (OC,C) in nb row blocks, bias (OC) or NULL
void matmul_forward_blocks(float *out, const float *inp, const float *const *weight,
			   const int *rows, int nb, const float *bias, int N, int C, int OC)
{
	// out[:, r:r+rows[b]] = inp @ weight_b^T: block b's columns of out
	for (int b = 0, r = 0; b < nb; r += rows[b], b++) {
		if (N <= SL_MATMUL_FEW_ROWS)
			matmul_few_rows(out + r, inp, weight[b], rows[b], N, C, OC);
		else
			cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, rows[b], C, 1.0f,
				    inp, C, weight[b], C, 0.0f, out + r, OC);
	}
	if (bias != NULL) {
#pragma omp parallel for schedule(static) if ((size_t)N * OC > 32768)
		for (int i = 0; i < N; i++) {
			float *o = out + (size_t)i * OC;
#pragma omp simd
			for (int j = 0; j < OC; j++)
				o[j] += bias[j];
		}
	}
}

// out (N,OC), inp (N,C), weight (OC,C), bias (OC) or NULL
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC)
{
	matmul_forward_blocks(out, inp, &weight, &OC, 1, bias, N, C, OC);
}

// dinp (N,C) =, dweight (OC,C) += in nb row blocks, dbias (OC) += or NULL, dout (N,OC),
// inp (N,C), weight (OC,C) in the same row blocks
void matmul_backward_blocks(float *dinp, float *const *dweight, float *dbias, const float *dout,
			    const float *inp, const float *const *weight, const int *rows, int nb,
			    int N, int C, int OC)
{
	// dinp = dout @ weight = sum over b of dout[:, r:r+rows[b]] @ weight_b, in block order
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, rows[b], 1.0f, dout + r,
			    OC, weight[b], C, b == 0 ? 0.0f : 1.0f, dinp, C);
	// dweight_b += dout[:, r:r+rows[b]]^T @ inp
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows[b], C, N, 1.0f, dout + r, OC,
			    inp, C, 1.0f, dweight[b], C);
	if (dbias != NULL) {
/* column sums of dout: each thread owns a contiguous block of columns (whole 16-float
 * runs) and walks the rows, so the inner loop is contiguous and vectorised and no two
 * threads write the same dbias entry. */
#pragma omp parallel if ((size_t)N * OC > 32768)
		{
			int j0, j1;
			thread_runs16(OC, &j0, &j1);
			for (int i = 0; i < N; i++) {
				const float *d = dout + (size_t)i * OC;
#pragma omp simd
				for (int j = j0; j < j1; j++)
					dbias[j] += d[j];
			}
		}
	}
}

// dinp (N,C) =, dweight (OC,C) +=, dbias (OC) += or NULL, dout (N,OC), inp (N,C),
// weight (OC,C)
void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
		     const float *weight, int N, int C, int OC)
{
	matmul_backward_blocks(dinp, &dweight, dbias, dout, inp, &weight, &OC, 1, N, C, OC);
}
