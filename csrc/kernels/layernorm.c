/* LayerNorm over the last dimension (as torch.nn.LayerNorm: biased variance, eps 1e-5). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include "parallel.h"

#define LN_EPS 1e-5f

// out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C)
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
		       const float *bias, int N, int C)
{
#pragma omp parallel for schedule(static) if ((size_t)N * C > 32768)
	for (int i = 0; i < N; i++) {
		const float *x = inp + (size_t)i * C;
		float *o = out + (size_t)i * C;
		float s = 0.0f;
#pragma omp simd reduction(+ : s)
		for (int c = 0; c < C; c++)
			s += x[c];
		float m = s / C;
		/* m corrected by the mean of x - m: the first sum's rounding (up to ~C u |mean|)
		 * would sit in every x - m, all there is of a row whose |mean| >> its spread (a
		 * constant row of 10000.1 got rstd 46% off and outputs 0.8 from the bias) */
		float sd = 0.0f;
#pragma omp simd reduction(+ : sd)
		for (int c = 0; c < C; c++)
			sd += x[c] - m;
		m += sd / C;
		/* two passes (variance of centred values): no cancellation when |mean| >> std */
		float v = 0.0f;
#pragma omp simd reduction(+ : v)
		for (int c = 0; c < C; c++) {
			float d = x[c] - m;
			v += d * d;
		}
		float r = 1.0f / sqrtf(v / C + LN_EPS);
#pragma omp simd
		for (int c = 0; c < C; c++)
			o[c] = (x[c] - m) * r * weight[c] + bias[c];
		mean[i] = m;
		rstd[i] = r;
	}
}

// dinp (N,C) = or +=, dweight (C) +=, dbias (C) +=, dout (N,C), inp (N,C), weight (C),
// mean (N), rstd (N)
void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
			const float *inp, const float *weight, const float *mean, const float *rstd,
			int N, int C, int accumulate)
{
#pragma omp parallel
	{
/* dinp, row by row.  With xn = (x - mean) * rstd and g = weight * dout:
 *   dx = rstd * (g - mean(g) - xn * mean(g * xn)) */
#pragma omp for schedule(static) nowait
		for (int i = 0; i < N; i++) {
			const float *x = inp + (size_t)i * C;
			const float *dy = dout + (size_t)i * C;
			float *dx = dinp + (size_t)i * C;
			float m = mean[i], r = rstd[i];
			float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
			for (int c = 0; c < C; c++) {
				float g = weight[c] * dy[c];
				sg += g;
				sgx += g * ((x[c] - m) * r);
			}
			float mg = sg / C, mgx = sgx / C;
			if (accumulate) {
#pragma omp simd
				for (int c = 0; c < C; c++)
					dx[c] += r *
						 (weight[c] * dy[c] - mg - ((x[c] - m) * r) * mgx);
			} else {
#pragma omp simd
				for (int c = 0; c < C; c++)
					dx[c] = r *
						(weight[c] * dy[c] - mg - ((x[c] - m) * r) * mgx);
			}
		}
		/* (nowait: this pass only reads what the loop above reads)
		 * dweight, dbias: sums over rows.  Each thread owns a contiguous block of channels
		 * (whole 16-float runs) and walks all rows: no race, no per-thread buffers, and the
		 * summation order does not depend on the team size. */
		int c0, c1;
		thread_runs16(C, &c0, &c1);
		for (int i = 0; i < N; i++) {
			const float *x = inp + (size_t)i * C;
			const float *dy = dout + (size_t)i * C;
			float m = mean[i], r = rstd[i];
#pragma omp simd
			for (int c = c0; c < c1; c++) {
				dweight[c] += dy[c] * ((x[c] - m) * r);
				dbias[c] += dy[c];
			}
		}
	}
}
