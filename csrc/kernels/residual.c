/* Residual connection. */
#include "kernels.h"
#include <omp.h>

// out (N) = inp1 (N) + inp2 (N)
void residual_forward(float *out, const float *inp1, const float *inp2, size_t N)
{
#pragma omp parallel for simd schedule(static) if (N > 32768)
	for (size_t i = 0; i < N; i++)
		out[i] = inp1[i] + inp2[i];
}

// dinp1 (N) +=, dinp2 (N) +=, dout (N)
void residual_backward(float *dinp1, float *dinp2, const float *dout, size_t N)
{
#pragma omp parallel for simd schedule(static) if (N > 32768)
	for (size_t i = 0; i < N; i++) {
		dinp1[i] += dout[i];
		dinp2[i] += dout[i];
	}
}
