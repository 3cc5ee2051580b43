/* Small helpers: zeroing, in-place add (gradient reduction), copy, batch loading. */
#include "kernels.h"
#include <omp.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* A 16-row greedy draw copies 3.2 MB of logits; each copy freed went back to the kernel and the
 * next step's faulted in again: 1538 page faults, 3.4 ms of a 0.5 ms draw on the 2-core VM. */
void keep_freed_memory(void)
{
#ifdef __GLIBC__
	mallopt(M_MMAP_THRESHOLD, 32 << 20); /* glibc's largest; also ends its sliding threshold */
	mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

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
