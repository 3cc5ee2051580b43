/* Fully connected layer on cuBLAS: out = inp @ weight^T + bias, the weight possibly in row
 * blocks (the tied lm head's wte). Row-major (r, c) with leading dimension ld is, to cuBLAS
 * (column-major), its transpose (c, r) with the same ld: each GEMM below is the CPU kernel's
 * (csrc/kernels/matmul.c) written for the transposes. */
#include "gpu.h"

// out (N,OC) += bias (OC) on every row
static __global__ void add_bias_kernel(float *out, const float *bias, int N, int OC)
{
	size_t n = (size_t)N * OC;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		out[i] += bias[i % OC];
}

// dout[i, c]: dbias's column sums
struct dout_col_term {
	const float *dout;
	int OC;
	__device__ void operator()(int i, int c, float *v) const { v[0] = dout[(size_t)i * OC + c]; }
};

// out (N,OC), inp (N,C), weight (OC,C) in nb row blocks, bias (OC) or NULL
void matmul_forward_cuda(const struct sl_gpu *g, float *out, const float *inp,
			 const float *const *weight, const int *rows, int nb, const float *bias,
			 int N, int C, int OC)
{
	/* out[:, r:r+rows[b]] = inp @ weight_b^T, i.e. out_b^T (rows_b, N) = weight_b (rows_b, C)
	 * @ inp^T (C, N): column-major A = weight_b^T seen as (C, rows_b) transposed */
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		sl_gemm(g, CUBLAS_OP_T, CUBLAS_OP_N, rows[b], N, C, 1.0f, weight[b], C, inp, C, 0.0f,
			out + r, OC);
	if (bias && N > 0)
		SL_LAUNCH(add_bias_kernel, sl_blocks((size_t)N * OC, 256), 256, 0, sl_stream(g), out,
			  bias, N, OC);
}

// dinp (N,C) =, dweight (OC,C) += in nb row blocks, dbias (OC) += or NULL, dout (N,OC),
// inp (N,C), weight (OC,C) in the same row blocks
void matmul_backward_cuda(const struct sl_gpu *g, float *dinp, float *const *dweight,
			  float *dbias, const float *dout, const float *inp,
			  const float *const *weight, const int *rows, int nb, int N, int C, int OC)
{
	/* dinp = sum over blocks of dout[:, r:r+rows_b] @ weight_b: dinp^T (C, N) = weight_b^T
	 * (C, rows_b) @ dout_b^T (rows_b, N), the blocks added in block order */
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		sl_gemm(g, CUBLAS_OP_N, CUBLAS_OP_N, C, N, rows[b], 1.0f, weight[b], C, dout + r, OC,
			b == 0 ? 0.0f : 1.0f, dinp, C);
	/* dweight_b += dout_b^T @ inp: dweight_b^T (C, rows_b) += inp^T (C, N) @ dout_b (N,
	 * rows_b) */
	for (int b = 0, r = 0; b < nb; r += rows[b], b++)
		sl_gemm(g, CUBLAS_OP_N, CUBLAS_OP_T, C, rows[b], N, 1.0f, inp, C, dout + r, OC, 1.0f,
			dweight[b], C);
	/* dbias (OC) += column sums of dout (N,OC) (gpu.h: two passes) */
	if (dbias)
		sl_column_sums<1>(g, dbias, NULL, dout_col_term{ dout, OC }, N, OC);
}
