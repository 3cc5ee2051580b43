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
 * threads split the weight's rows, and each tile of TJ weight rows, read from memory once, is
 * multiplied with every input row from cache (tiles of TI input rows x TJ weight rows).
 * Each entry is one fixed sequence of operations, whatever N, the tile, the vector width, the
 * thread or the team: 16 lane sums over k = l mod 16, the lanes added as a tree (l + l+8, then
 * + l+4, + l+2, + l+1) and the tail (C mod 16) last. A row's output does not depend on the other
 * rows of the step (a sequence decoded alone or in a batch gives the same bits).
 *
 * With AVX-512 an entry's 16 lanes are one vector and a tile is 4 x 4: 16 accumulators and 8
 * loaded vectors, 24 of the 32 registers. Otherwise (AVX2: 16 registers of 8 floats) an entry
 * is two 8-float halves, lanes 0-7 and 8-15, and a tile 2 x 2: GCC keeps a 16-float vector in
 * memory there (4 x 4 of them ran at 20 GFLOP/s on 2 Zen 4 cores built for Haswell).
 * SL_FEW_ROWS_WIDTH=16 or 8 chooses either on any machine (the test of their bits). */
#ifndef SL_FEW_ROWS_WIDTH
#ifdef __AVX512F__
#define SL_FEW_ROWS_WIDTH 16
#else
#define SL_FEW_ROWS_WIDTH 8
#endif
#endif
#if SL_FEW_ROWS_WIDTH == 16
#define W 16		// floats in a vector
#define TI 4
#define TJ 4
#else
#define W 8
#define TI 2
#define TJ 2
#endif
#define H (16 / W)	// vectors per entry: lanes 0..W-1, then W..15
typedef float vec __attribute__((vector_size(W * 4), aligned(4), may_alias));

/* The value in a register from here on: each vector of the tile loaded once per k, not folded
 * into each of its multiply-adds as a memory operand (GCC 12 did at 4 x 4: 20 loads for 16
 * FMAs, 60 -> 85 GFLOP/s on one Zen 4 core with the weight in cache). */
#if defined(__GNUC__) && (W == 16 ? defined(__AVX512F__) : defined(__AVX__))
#define REGISTER(v) __asm__("" : "+v"(v))
#else
#define REGISTER(v) ((void)0)
#endif

#if W == 16
typedef int veci __attribute__((vector_size(64)));

/* The lane sums of 16 accumulators at once, (*r)[q] = the sum of a[rev(q)]'s lanes (rev: the
 * 4 bits of q reversed), each summed by the tree: at each level a shuffle pairs the halves of
 * two vectors' blocks and one add sums them, 15 vector adds and 30 shuffles for 240 scalar adds
 * (at C = 768 a 4 x 4 tile 15 % faster). */
static inline __attribute__((always_inline)) void lane_sums16(vec *r, const vec a[16])
{
	const veci h1 = { 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23 };
	const veci h2 = { 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27 };
	const veci h3 = { 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29 };
	const veci h4 = { 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30 };
	vec b[8], c[4], d[2];
	for (int m = 0; m < 8; m++)	// lanes l and l + 8
		b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], h1) +
		       __builtin_shuffle(a[2 * m], a[2 * m + 1], h1 + 8);
	for (int m = 0; m < 4; m++)	// + l + 4
		c[m] = __builtin_shuffle(b[2 * m], b[2 * m + 1], h2) +
		       __builtin_shuffle(b[2 * m], b[2 * m + 1], h2 + 4);
	for (int m = 0; m < 2; m++)	// + l + 2
		d[m] = __builtin_shuffle(c[2 * m], c[2 * m + 1], h3) +
		       __builtin_shuffle(c[2 * m], c[2 * m + 1], h3 + 2);
	*r = __builtin_shuffle(d[0], d[1], h4) + __builtin_shuffle(d[0], d[1], h4 + 1);
}
#endif

static inline __attribute__((always_inline)) void
matmul_tile(float *out, const float *inp, const float *w, int ni, int nj, int C, int OC)
{
	// out (ni,OC) columns 0..nj-1, inp (ni,C), w (nj,C): ni <= TI, nj <= TJ, constants when inlined
	vec acc[TI][TJ][H] = { { { { 0 } } } };
	const int C16 = C & ~15;
	for (int k = 0; k < C16; k += 16)
		for (int h = 0; h < H; h++) {
			vec wv[TJ], xv[TI];
			for (int j = 0; j < nj; j++) {
				wv[j] = *(const vec *)(w + (size_t)j * C + k + h * W);
				REGISTER(wv[j]);
			}
			for (int i = 0; i < ni; i++) {
				xv[i] = *(const vec *)(inp + (size_t)i * C + k + h * W);
				REGISTER(xv[i]);
			}
			for (int i = 0; i < ni; i++)
				for (int j = 0; j < nj; j++)
					acc[i][j][h] += xv[i] * wv[j];
		}
	float sums[TI][TJ];
#if W == 16
	// acc[i][j] fed at rev(4 i + j), so that sums[i][j] is its lane sum (rev: an involution)
	vec a[16] = { { 0 } }, r;
	for (int q = 0; q < 16; q++) {
		const int i = (q & 1) << 1 | (q & 2) >> 1, j = (q & 4) >> 1 | (q & 8) >> 3;
		if (i < ni && j < nj)
			a[q] = acc[i][j][0];
	}
	lane_sums16(&r, a);
	for (int i = 0; i < ni; i++)
		for (int j = 0; j < nj; j++)
			sums[i][j] = r[4 * i + j];
#else
	for (int i = 0; i < ni; i++)
		for (int j = 0; j < nj; j++) {
			const vec b = acc[i][j][0] + acc[i][j][1];	// lanes l and l + 8
			sums[i][j] = ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]));
		}
#endif
	for (int i = 0; i < ni; i++)
		for (int j = 0; j < nj; j++) {
			float t = 0.0f;
			for (int k = C16; k < C; k++)
				t += inp[(size_t)i * C + k] * w[(size_t)j * C + k];
			out[(size_t)i * OC + j] = sums[i][j] + t;
		}
}

// out (N,OC) columns 0..R-1 = inp (N,C) @ w (R,C)^T. With more than TI rows (a tile read
// ceil(N / TI) times) each tile of TJ weight rows is first copied to 64-byte aligned memory of
// the thread: numpy's buffers (glibc's) sit 16 bytes past a cache line, so each 64-byte load
// of the tile's passes would straddle two lines (measured at N = 16 on the 2-core Zen 4: a
// step's matmuls 12 % faster, 50 -> 44 ms). The copy changes no value: the same bits.
static void matmul_few_rows(float *out, const float *inp, const float *w, int R, int N, int C,
			    int OC)
{
#pragma omp parallel if ((size_t)R * C > 65536)
	{
		float *tile = N > TI && (uintptr_t)w % 64 != 0
				      ? aligned_alloc(64, ((size_t)TJ * C * sizeof(float) + 63) & ~(size_t)63)
				      : NULL; /* NULL: the tiles read where they are */
#pragma omp for schedule(static)
		for (int j = 0; j < R; j += TJ) {
			const float *wj = w + (size_t)j * C;
			float *oj = out + j;
			int i = 0;
			if (R - j >= TJ) {
				if (tile != NULL)
					wj = memcpy(tile, wj, (size_t)TJ * C * sizeof(float));
				for (; i + TI <= N; i += TI)
					matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, TI, TJ, C, OC);
				switch (N - i) {	// the last 1..TI-1 input rows
#if TI == 4
				case 3: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 3, TJ, C, OC); break;
				case 2: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 2, TJ, C, OC); break;
#endif
				case 1: matmul_tile(oj + (size_t)i * OC, inp + (size_t)i * C, wj, 1, TJ, C, OC); break;
				}
			} else {	// the last 1..TJ-1 weight rows
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
