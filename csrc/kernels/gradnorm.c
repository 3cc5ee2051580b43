/* Global L2 norm of the gradients, for gradient clipping: per-tensor sums of squares, their
 * sum, and the clipping factor. */
#include "kernels.h"
#include "clip.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define SUMSQ_BLK 4096

/* The sum of squares of one block, in double. A float times a float is exact in double
 * (24 + 24 significant bits < 53), so only the additions round. */
static double block_sumsq(const float *x, size_t len)
{
	double s = 0.0;
#pragma omp simd reduction(+ : s)
	for (size_t i = 0; i < len; i++)
		s += (double)x[i] * (double)x[i];
	return s;
}

// out (1) = sum_i x[i]^2, x (n)
void sum_of_squares(double *out, const float *x, size_t n)
{
	/* The block sums are added in block order whatever the team size: threads compute whole
	 * blocks into part[], one thread sums part[]. Without memory for part[], the same sums
	 * in the same order on one thread. */
	size_t nblk = (n + SUMSQ_BLK - 1) / SUMSQ_BLK;
	double *part = nblk > 1 ? malloc(nblk * sizeof *part) : NULL;
	double s = 0.0;
	if (part) {
#pragma omp parallel for schedule(static) if (n > 65536)
		for (size_t k = 0; k < nblk; k++) {
			size_t i0 = k * SUMSQ_BLK;
			part[k] = block_sumsq(x + i0, n - i0 < SUMSQ_BLK ? n - i0 : SUMSQ_BLK);
		}
		for (size_t k = 0; k < nblk; k++)
			s += part[k];
		free(part);
	} else {
		for (size_t k = 0; k < nblk; k++) {
			size_t i0 = k * SUMSQ_BLK;
			s += block_sumsq(x + i0, n - i0 < SUMSQ_BLK ? n - i0 : SUMSQ_BLK);
		}
	}
	*out = s;
}

// out (1) = x[0] + x[1] + ... + x[n-1], left to right
void sum_f64(double *out, const double *x, int n)
{
	double s = 0.0;
	for (int i = 0; i < n; i++)
		s += x[i];
	*out = s;
}

// min(1, max_norm / (||g|| + 1e-6)), ||g|| = sqrt(sumsq): clip.h's formula
float clip_scale(double sumsq, float max_norm) { return sl_clip_scale(sumsq, max_norm); }
