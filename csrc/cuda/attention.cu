/* Causal multi-head self-attention: per head h, over the batch's B sequences at once (one
 * strided batched GEMM, the sequences T 3C floats apart in qkv), the scores
 * preatt = scale q k^T, a softmax kernel (causal mask, preatt and att above the diagonal
 * written 0, as the CPU kernel does), and out = att v. Row-major (r, c) with leading
 * dimension ld is, to cuBLAS (column-major), its transpose (c, r): each product is written
 * for the transposes below. The full T x T products are computed; the mask zeroes the upper
 * triangle, whose products then add exact zeros. */
#include "gpu.h"

#define ROWS_PER_BLOCK 8 /* softmax kernels: a warp per row */

/* Rows r of (B*NH*T, T): the query is t = r % T and sees keys 0..t.
 * pre holds scale q.k for every key; att = softmax over keys 0..t; both 0 beyond t. */
static __global__ void attention_softmax_kernel(float *preatt, float *att, int rows, int T)
{
	int lane = threadIdx.x % 32;
	for (int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; r < rows;
	     r += gridDim.x * ROWS_PER_BLOCK) {
		float *pre = preatt + (size_t)r * T, *a = att + (size_t)r * T;
		int t = r % T;
		float mx = -INFINITY;
		for (int j = lane; j <= t; j += 32)
			mx = fmaxf(mx, pre[j]);
		mx = sl_warp_max(mx);
		float sum = 0.0f;
		for (int j = lane; j <= t; j += 32) {
			float e = expf(pre[j] - mx);
			a[j] = e;
			sum += e;
		}
		float inv = 1.0f / sl_warp_sum(sum);
		for (int j = lane; j < T; j += 32) {
			if (j <= t) {
				a[j] *= inv;
			} else {
				pre[j] = 0.0f;
				a[j] = 0.0f;
			}
		}
	}
}

/* Softmax backward on rows r of (B*NH*T, T): dp = att (datt - sum(att datt)) over keys 0..t
 * (the score scaling is applied by the GEMMs that use dp); dp and datt 0 beyond t. */
static __global__ void attention_softmax_backward_kernel(float *dpreatt, float *datt,
							 const float *att, int rows, int T)
{
	int lane = threadIdx.x % 32;
	for (int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; r < rows;
	     r += gridDim.x * ROWS_PER_BLOCK) {
		const float *a = att + (size_t)r * T;
		float *da = datt + (size_t)r * T, *dp = dpreatt + (size_t)r * T;
		int t = r % T;
		float s = 0.0f;
		for (int j = lane; j <= t; j += 32)
			s += a[j] * da[j];
		s = sl_warp_sum(s);
		for (int j = lane; j < T; j += 32) {
			if (j <= t) {
				dp[j] = a[j] * (da[j] - s);
			} else {
				da[j] = 0.0f;
				dp[j] = 0.0f;
			}
		}
	}
}

static unsigned softmax_blocks(int rows) { return sl_blocks((size_t)rows, ROWS_PER_BLOCK, 65535); }

// out (B,T,C), preatt (B,NH,T,T), att (B,NH,T,T), qkv (B,T,3C) = [q | k | v] per token
void attention_forward_cuda(const struct sl_gpu *g, float *out, float *preatt, float *att,
			    const float *qkv, int B, int T, int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int C3 = 3 * C, hs = C / NH;
	const long long seq = (long long)T * C3, head = (long long)NH * T * T;
	const float scale = 1.0f / sqrtf((float)hs);
	for (int h = 0; h < NH; h++) {
		const float *q = qkv + h * hs, *k = qkv + C + h * hs;
		/* preatt[t][j] = scale q_t . k_j: preatt^T (T, T) = k (T, hs) @ q^T (hs, T) */
		sl_gemm_batched(g, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, k, C3, seq, q, C3, seq,
				0.0f, preatt + (size_t)h * T * T, T, head, B);
	}
	int rows = B * NH * T;
	SL_LAUNCH(attention_softmax_kernel, softmax_blocks(rows), 32 * ROWS_PER_BLOCK, 0,
		  sl_stream(g), preatt, att, rows, T);
	for (int h = 0; h < NH; h++) {
		/* out_t = sum_j att[t][j] v_j: out^T (hs, T) = v^T (hs, T) @ att^T (T, T) */
		sl_gemm_batched(g, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, qkv + 2 * C + h * hs, C3,
				seq, att + (size_t)h * T * T, T, head, 0.0f, out + h * hs, C,
				(long long)T * C, B);
	}
}

// dqkv (B,T,3C) =, dpreatt (B,NH,T,T) =, datt (B,NH,T,T) =, dout (B,T,C), qkv, att
void attention_backward_cuda(const struct sl_gpu *g, float *dqkv, float *dpreatt, float *datt,
			     const float *dout, const float *qkv, const float *att, int B, int T,
			     int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int C3 = 3 * C, hs = C / NH;
	const long long seq = (long long)T * C3, head = (long long)NH * T * T;
	const long long dseq = (long long)T * C;
	const float scale = 1.0f / sqrtf((float)hs);
	for (int h = 0; h < NH; h++) {
		const float *v = qkv + 2 * C + h * hs, *dy = dout + h * hs;
		const float *a = att + (size_t)h * T * T;
		/* datt[t][j] = dy_t . v_j: datt^T (T, T) = v (T, hs) @ dy^T (hs, T) */
		sl_gemm_batched(g, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, v, C3, seq, dy, C, dseq,
				0.0f, datt + (size_t)h * T * T, T, head, B);
		/* dv_j = sum_t att[t][j] dy_t: dv^T (hs, T) = dy^T (hs, T) @ att (T, T) */
		sl_gemm_batched(g, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dy, C, dseq, a, T, head,
				0.0f, dqkv + 2 * C + h * hs, C3, seq, B);
	}
	int rows = B * NH * T;
	SL_LAUNCH(attention_softmax_backward_kernel, softmax_blocks(rows), 32 * ROWS_PER_BLOCK, 0,
		  sl_stream(g), dpreatt, datt, att, rows, T);
	for (int h = 0; h < NH; h++) {
		const float *q = qkv + h * hs, *k = qkv + C + h * hs;
		const float *dp = dpreatt + (size_t)h * T * T;
		/* dq_t = scale sum_j dp[t][j] k_j: dq^T (hs, T) = k^T (hs, T) @ dp^T (T, T) */
		sl_gemm_batched(g, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, scale, k, C3, seq, dp, T, head,
				0.0f, dqkv + h * hs, C3, seq, B);
		/* dk_j = scale sum_t dp[t][j] q_t: dk^T (hs, T) = q^T (hs, T) @ dp (T, T) */
		sl_gemm_batched(g, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, scale, q, C3, seq, dp, T, head,
				0.0f, dqkv + C + h * hs, C3, seq, B);
	}
}
