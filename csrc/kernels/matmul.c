/* Fully connected layer: out = inp @ weight^T + bias, via BLAS sgemm. */
#include "kernels.h"
#include "blas.h" /* <cblas.h> (OpenBLAS) or MKL's, chosen by the build */
#include <omp.h>
#include "parallel.h"

// out (N,OC), inp (N,C), weight (OC,C), bias (OC) or NULL
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC)
{
	cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
		    0.0f, out, OC);
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

// dinp (N,C) =, dweight (OC,C) +=, dbias (OC) += or NULL, dout (N,OC), inp (N,C),
// weight (OC,C)
void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
		     const float *weight, int N, int C, int OC)
{
	// dinp = dout @ weight
	cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
		    0.0f, dinp, C);
	// dweight += dout^T @ inp
	cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
		    dweight, C);
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
