/* Fully connected layer: out = inp @ weight^T + bias, via BLAS sgemm; the weight may come in
 * row blocks (the tied lm head's wte, kernels.h). */
#include "kernels.h"
#include "blas.h" /* <cblas.h> (OpenBLAS) or MKL's, chosen by the build */
#include <omp.h>
#include "parallel.h"

// out (N,OC), inp (N,C), weight (OC,C) in nb row blocks, bias (OC) or NULL
void matmul_forward_blocks(float *out, const float *inp, const float *const *weight,
			   const int *rows, int nb, const float *bias, int N, int C, int OC)
{
	// out[:, r:r+rows[b]] = inp @ weight_b^T: block b's columns of out
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, rows[b], C, 1.0f, inp, C,
			    weight[b], C, 0.0f, out + r, OC);
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
