/* LayerNorm over the last dimension (as torch.nn.LayerNorm: biased variance, eps 1e-5). */
#include "gpu.h"

#define LN_EPS 1e-5f
#define ROWS_PER_BLOCK 8 /* a warp per row */

// out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C): a warp per row
static __global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd,
						const float *inp, const float *weight,
						const float *bias, int N, int C)
{
	int lane = threadIdx.x % 32;
	for (int i = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; i < N;
	     i += gridDim.x * ROWS_PER_BLOCK) {
		const float *x = inp + (size_t)i * C;
		float s = 0.0f;
		for (int c = lane; c < C; c += 32)
			s += x[c];
		float m = sl_warp_sum(s) / C;
		/* m corrected by the mean of x - m (the CPU kernel's, layernorm.c: why) */
		float sd = 0.0f;
		for (int c = lane; c < C; c += 32)
			sd += x[c] - m;
		m += sl_warp_sum(sd) / C;
		/* two passes (the variance of the centred values): no cancellation */
		float v = 0.0f;
		for (int c = lane; c < C; c += 32) {
			float d = x[c] - m;
			v += d * d;
		}
		float r = 1.0f / sqrtf(sl_warp_sum(v) / C + LN_EPS);
		float *o = out + (size_t)i * C;
		for (int c = lane; c < C; c += 32)
			o[c] = (x[c] - m) * r * weight[c] + bias[c];
		if (lane == 0) {
			mean[i] = m;
			rstd[i] = r;
		}
	}
}

/* dinp, a warp per row: with xn = (x - mean) rstd and g = weight dout,
 * dx = rstd (g - mean(g) - xn mean(g xn)); written, or added when accumulate */
static __global__ void layernorm_backward_rows(float *dinp, const float *dout, const float *inp,
					       const float *weight, const float *mean,
					       const float *rstd, int N, int C, int accumulate)
{
	int lane = threadIdx.x % 32;
	for (int i = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; i < N;
	     i += gridDim.x * ROWS_PER_BLOCK) {
		const float *x = inp + (size_t)i * C, *dy = dout + (size_t)i * C;
		float m = mean[i], r = rstd[i];
		float sg = 0.0f, sgx = 0.0f;
		for (int c = lane; c < C; c += 32) {
			float gc = weight[c] * dy[c];
			sg += gc;
			sgx += gc * ((x[c] - m) * r);
		}
		float mg = sl_warp_sum(sg) / C, mgx = sl_warp_sum(sgx) / C;
		float *dx = dinp + (size_t)i * C;
		for (int c = lane; c < C; c += 32) {
			float d = r * (weight[c] * dy[c] - mg - ((x[c] - m) * r) * mgx);
			dx[c] = accumulate ? dx[c] + d : d;
		}
	}
}

/* the two column sums of the backward at (row i, column c): dout xn (dweight), dout (dbias) */
struct layernorm_col_terms {
	const float *dout, *inp, *mean, *rstd;
	int C;
	__device__ void operator()(int i, int c, float *v) const
	{
		float dy = dout[(size_t)i * C + c];
		v[0] = dy * ((inp[(size_t)i * C + c] - mean[i]) * rstd[i]);
		v[1] = dy;
	}
};

void layernorm_forward_cuda(const struct sl_gpu *g, float *out, float *mean, float *rstd,
			    const float *inp, const float *weight, const float *bias, int N, int C)
{
	if (N > 0)
		SL_LAUNCH(layernorm_forward_kernel, sl_blocks(N, ROWS_PER_BLOCK, 65535),
			  32 * ROWS_PER_BLOCK, 0, sl_stream(g), out, mean, rstd, inp, weight, bias,
			  N, C);
}

void layernorm_backward_cuda(const struct sl_gpu *g, float *dinp, float *dweight, float *dbias,
			     const float *dout, const float *inp, const float *weight,
			     const float *mean, const float *rstd, int N, int C, int accumulate)
{
	if (N <= 0)
		return;
	SL_LAUNCH(layernorm_backward_rows, sl_blocks(N, ROWS_PER_BLOCK, 65535),
		  32 * ROWS_PER_BLOCK, 0, sl_stream(g), dinp, dout, inp, weight, mean, rstd, N, C,
		  accumulate);
	/* dweight += sum over rows of dout xn, dbias += sum of dout (gpu.h: two passes) */
	sl_column_sums<2>(g, dweight, dbias, layernorm_col_terms{ dout, inp, mean, rstd, C }, N, C);
}
