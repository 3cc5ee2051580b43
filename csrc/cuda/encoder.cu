/* Token + position embedding, forward and backward; wte (and dwte) possibly in row blocks. */
#include "gpu.h"

/* a matrix's row blocks, by value (kernels.h, "Row blocks") */
struct row_blocks {
	float *p[SL_GPU_MAX_BLOCKS];
	int rows[SL_GPU_MAX_BLOCKS];
	int nb;
};

static struct row_blocks blocks_of(const char *who, float *const *blk, const int *rows, int nb)
{
	if (nb < 1 || nb > SL_GPU_MAX_BLOCKS) {
		fprintf(stderr, "starpu_llm: %s: %d row blocks, the GPU kernels take 1 to %d\n", who,
			nb, SL_GPU_MAX_BLOCKS);
		abort();
	}
	struct row_blocks rb;
	rb.nb = nb;
	for (int b = 0; b < nb; b++) {
		rb.p[b] = blk[b];
		rb.rows[b] = rows[b];
	}
	return rb;
}

/* row v of the matrix: block b's row v - (rows of the blocks before b) */
static __device__ __forceinline__ float *row_of(const struct row_blocks &rb, int v, int C)
{
	int b = 0;
	while (b < rb.nb - 1 && v >= rb.rows[b])
		v -= rb.rows[b++];
	return rb.p[b] + (size_t)v * C;
}

// out (B,T,C) = wte[inp] + wpe[t]
static __global__ void encoder_forward_kernel(float *out, const int32_t *inp, struct row_blocks wte,
					      const float *wpe, int BT, int T, int C)
{
	size_t n = (size_t)BT * C;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
	     idx += (size_t)gridDim.x * blockDim.x) {
		int bt = (int)(idx / C), c = (int)(idx % C);
		out[idx] = row_of(wte, inp[bt], C)[c] + wpe[(size_t)(bt % T) * C + c];
	}
}

// out (N,C): row r = wte[idx[r].token] + wpe[idx[r].position]; idx (N,3)
static __global__ void encoder_decode_kernel(float *out, const int32_t *idx, struct row_blocks wte,
					     const float *wpe, int N, int C)
{
	size_t n = (size_t)N * C;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		int r = (int)(i / C), c = (int)(i % C);
		const int32_t *x = idx + 3 * (size_t)r;
		out[i] = row_of(wte, x[0], C)[c] + wpe[(size_t)x[2] * C + c];
	}
}

// dwte[inp[b,t]] += dout[b,t]: atomic, tokens repeat
static __global__ void encoder_backward_wte_kernel(struct row_blocks dwte, const float *dout,
						   const int32_t *inp, int BT, int C)
{
	size_t n = (size_t)BT * C;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
	     idx += (size_t)gridDim.x * blockDim.x) {
		int bt = (int)(idx / C), c = (int)(idx % C);
		atomicAdd(row_of(dwte, inp[bt], C) + c, dout[idx]);
	}
}

// dwpe[t] += dout[b,t] for b = 0..B-1 in order (as the CPU kernel adds them)
static __global__ void encoder_backward_wpe_kernel(float *dwpe, const float *dout, int B, int T,
						   int C)
{
	size_t n = (size_t)T * C;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
	     idx += (size_t)gridDim.x * blockDim.x) {
		float s = dwpe[idx];
		for (int b = 0; b < B; b++)
			s += dout[(size_t)b * T * C + idx];
		dwpe[idx] = s;
	}
}

void encoder_forward_cuda(const struct sl_gpu *g, float *out, const int32_t *inp,
			  const float *const *wte, const int *rows, int nb, const float *wpe,
			  int B, int T, int C)
{
	struct row_blocks rb = blocks_of("encoder_forward_cuda", (float *const *)wte, rows, nb);
	size_t n = (size_t)B * T * C;
	if (n)
		SL_LAUNCH(encoder_forward_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), out, inp,
			  rb, wpe, B * T, T, C);
}

void encoder_decode_cuda(const struct sl_gpu *g, float *out, const int32_t *idx,
			 const float *const *wte, const int *rows, int nb, const float *wpe, int N,
			 int C)
{
	struct row_blocks rb = blocks_of("encoder_decode_cuda", (float *const *)wte, rows, nb);
	size_t n = (size_t)N * C;
	if (n)
		SL_LAUNCH(encoder_decode_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), out, idx,
			  rb, wpe, N, C);
}

void encoder_backward_cuda(const struct sl_gpu *g, float *const *dwte, const int *rows, int nb,
			   float *dwpe, const float *dout, const int32_t *inp, int B, int T, int C)
{
	struct row_blocks rb = blocks_of("encoder_backward_cuda", dwte, rows, nb);
	size_t n = (size_t)B * T * C;
	if (!n)
		return;
	SL_LAUNCH(encoder_backward_wte_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), rb, dout,
		  inp, B * T, C);
	SL_LAUNCH(encoder_backward_wpe_kernel, sl_blocks((size_t)T * C, 256), 256, 0, sl_stream(g),
		  dwpe, dout, B, T, C);
}
