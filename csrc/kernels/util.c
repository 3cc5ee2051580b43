/* Small helpers: zeroing, in-place add (gradient reduction), copy, batch loading. */
#include "kernels.h"
#include <omp.h>
#include <string.h>

// x (n) = 0
void fill_zero(float *x, size_t n)
{
#pragma omp parallel for simd schedule(static) if (n > 65536)
	for (size_t i = 0; i < n; i++)
		x[i] = 0.0f;
}

// dst (n) += src (n)
void add_inplace(float *dst, const float *src, size_t n)
{
#pragma omp parallel for simd schedule(static) if (n > 32768)
	for (size_t i = 0; i < n; i++)
		dst[i] += src[i];
}

// dst (n) = src (n)
void copy_floats(float *dst, const float *src, size_t n)
{
	memcpy(dst, src, n * sizeof *dst);
}

// inputs (n), targets (n) int32; tokens uint16, needs n + 1 tokens from pos
void load_batch(int32_t *inputs, int32_t *targets, const uint16_t *tokens, size_t pos, size_t n)
{
	const uint16_t *tk = tokens + pos;
	for (size_t i = 0; i < n; i++) {
		inputs[i] = tk[i];
		targets[i] = tk[i + 1];
	}
}
