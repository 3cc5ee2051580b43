/* The gradient norm for clipping: one tensor's sum of squares, and the sum of partial sums. */
#include "gpu.h"

#define SUMSQ_THREADS 256
#define SUMSQ_MAX_BLOCKS 1024 /* ~8 blocks of 256 threads an SM on 132 SMs: the GPU full */
#define SUM_MAX_INPUTS 32

/* part[block] = the block's sum of x^2 in double (a float times a float is exact in double:
 * only the additions round); the grid, and so the order, depends on n alone */
static __global__ void sumsq_blocks_kernel(double *part, const float *x, size_t n)
{
	__shared__ double scratch[32];
	double s = 0.0;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		s += (double)x[i] * (double)x[i];
	s = sl_block_sum(s, scratch);
	if (threadIdx.x == 0)
		part[blockIdx.x] = s;
}

// out (1) = part[0] + ... + part[k-1]: thread t adds parts t, t + blockDim.x, ..., then the
// block's fixed-order sum (one block: the order depends on k alone)
static __global__ void sum_parts_kernel(double *out, const double *part, int k)
{
	__shared__ double scratch[32];
	double s = 0.0;
	for (int i = threadIdx.x; i < k; i += blockDim.x)
		s += part[i];
	s = sl_block_sum(s, scratch);
	if (threadIdx.x == 0)
		*out = s;
}

struct inputs {
	const double *p[SUM_MAX_INPUTS];
};

// out (1) = in[0] + ... + in[k-1], in order (each a device scalar)
static __global__ void sum_inputs_kernel(double *out, struct inputs in, int k)
{
	if (threadIdx.x == 0 && blockIdx.x == 0) {
		double s = 0.0;
		for (int i = 0; i < k; i++)
			s += *in.p[i];
		*out = s;
	}
}

void sum_of_squares_cuda(const struct sl_gpu *g, double *out, const float *x, size_t n)
{
	/* pass 1: the blocks' partial sums into the worker's scratch (allocated at its start);
	 * pass 2: their sum */
	unsigned blocks = sl_blocks(n, 4 * SUMSQ_THREADS, SUMSQ_MAX_BLOCKS);
	static_assert(SUMSQ_MAX_BLOCKS * sizeof(double) <= SL_GPU_SCRATCH_BYTES, "scratch");
	sl_require_scratch(g, "sum_of_squares");
	double *part = (double *)g->scratch;
	SL_LAUNCH(sumsq_blocks_kernel, blocks, SUMSQ_THREADS, 0, sl_stream(g), part, x, n);
	SL_LAUNCH(sum_parts_kernel, 1, SUMSQ_THREADS, 0, sl_stream(g), out, part, (int)blocks);
}

void sum_f64_cuda(const struct sl_gpu *g, double *out, const double *const *in, int k)
{
	if (k > SUM_MAX_INPUTS) {
		fprintf(stderr, "starpu_llm: sum_f64_cuda: %d inputs, at most %d\n", k,
			SUM_MAX_INPUTS);
		abort();
	}
	struct inputs a;
	for (int i = 0; i < k; i++)
		a.p[i] = in[i];
	SL_LAUNCH(sum_inputs_kernel, 1, 32, 0, sl_stream(g), out, a, k);
}
