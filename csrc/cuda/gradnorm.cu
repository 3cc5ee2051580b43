/* The gradient norm for clipping: one tensor's sum of squares, and the sum of partial sums. */
#include "gpu.h"

#define SUMSQ_THREADS 256
#define SUMSQ_MAX_BLOCKS 256
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

// out (1) = part[0] + ... + part[k-1], in order
static __global__ void sum_parts_kernel(double *out, const double *part, int k)
{
	if (threadIdx.x == 0 && blockIdx.x == 0) {
		double s = 0.0;
		for (int i = 0; i < k; i++)
			s += part[i];
		*out = s;
	}
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
	unsigned blocks = sl_blocks(n, 4 * SUMSQ_THREADS, SUMSQ_MAX_BLOCKS);
	double *part;
	/* the partial sums live only inside the task: stream-ordered memory, freed after use */
	SL_CUDA_CHECK(cudaMallocAsync((void **)&part, blocks * sizeof *part, sl_stream(g)));
	SL_LAUNCH(sumsq_blocks_kernel, blocks, SUMSQ_THREADS, 0, sl_stream(g), part, x, n);
	SL_LAUNCH(sum_parts_kernel, 1, 32, 0, sl_stream(g), out, part, (int)blocks);
	SL_CUDA_CHECK(cudaFreeAsync(part, sl_stream(g)));
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
