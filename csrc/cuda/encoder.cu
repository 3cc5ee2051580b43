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

/* dwte in the CPU kernel's order (encoder_backward_blocks: each (v, c) adds the rows of v's
 * positions bt = 0, 1, ... in turn into its old value), without atomics: the positions sorted
 * by (token, bt) into the worker's scratch, then one thread per (token, c) adds its rows in
 * that order. The same additions in the same order: the CPU's bits, on every run. The sort is
 * one block's bitonic network over ENC_SORT_MAX positions at most (what the scratch holds;
 * more are taken in chunks, in bt order, which keeps the order); the additions fill the GPU
 * (B T = 8192, C = 768: a thread per (sorted position, c), those at a token's first
 * position adding; a token's run of k rows is k dependent additions, as on the CPU). */
#define ENC_SORT_MAX ((int)(SL_GPU_SCRATCH_BYTES / sizeof(uint64_t))) /* a power of 2 */
#define ENC_SORT_THREADS 1024

// key (n2) = (inp[bt] << 32 | bt) for bt < n, padded with ~0 (last), sorted ascending:
// n2 a power of 2, one block. The keys are distinct: one sorted order, whatever the network.
static __global__ void encoder_sort_kernel(uint64_t *key, const int32_t *inp, int n, int n2)
{
	for (int i = threadIdx.x; i < n2; i += blockDim.x)
		key[i] = i < n ? (uint64_t)(uint32_t)inp[i] << 32 | (uint32_t)i : ~(uint64_t)0;
	__syncthreads();
	/* stage (k, j): pair p of the n2 / 2 is (i, i + j), i = p with a 0 bit inserted at j;
	 * ascending where i & k is 0 */
	for (int k = 2; k <= n2; k <<= 1)
		for (int j = k >> 1; j > 0; j >>= 1) {
			for (int p = threadIdx.x; p < n2 / 2; p += blockDim.x) {
				int i = ((p & ~(j - 1)) << 1) | (p & (j - 1));
				uint64_t a = key[i], b = key[i + j];
				if ((a > b) == ((i & k) == 0)) {
					key[i] = b;
					key[i + j] = a;
				}
			}
			__syncthreads();
		}
}

// dwte[v] += dout[bt] for v's positions bt in order: key (n) sorted (encoder_sort_kernel),
// dout (n,C); thread (i, c) adds when i is its token's first sorted position
static __global__ void encoder_backward_wte_kernel(struct row_blocks dwte, const float *dout,
						   const uint64_t *key, int n, int C)
{
	size_t total = (size_t)n * C;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
	     idx += (size_t)gridDim.x * blockDim.x) {
		int i = (int)(idx / C), c = (int)(idx % C);
		uint32_t v = (uint32_t)(key[i] >> 32);
		if (i > 0 && (uint32_t)(key[i - 1] >> 32) == v)
			continue;
		int end = i + 1;
		while (end < n && (uint32_t)(key[end] >> 32) == v)
			end++;
		float *w = row_of(dwte, (int)v, C) + c;
		float s = *w;
#pragma unroll 4
		for (int j = i; j < end; j++)
			s += dout[(size_t)(uint32_t)key[j] * C + c];
		*w = s;
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
	sl_require_scratch(g, "encoder_backward's sorted positions");
	uint64_t *key = (uint64_t *)g->scratch;
	for (int b0 = 0; b0 < B * T; b0 += ENC_SORT_MAX) {
		int m = B * T - b0 < ENC_SORT_MAX ? B * T - b0 : ENC_SORT_MAX, m2 = 1;
		while (m2 < m)
			m2 <<= 1;
		int threads = m2 / 2 < ENC_SORT_THREADS ? (m2 > 1 ? m2 / 2 : 1) : ENC_SORT_THREADS;
		SL_LAUNCH(encoder_sort_kernel, 1, threads, 0, sl_stream(g), key, inp + b0, m, m2);
		SL_LAUNCH(encoder_backward_wte_kernel, sl_blocks((size_t)m * C, 256), 256, 0,
			  sl_stream(g), rb, dout + (size_t)b0 * C, key, m, C);
	}
	SL_LAUNCH(encoder_backward_wpe_kernel, sl_blocks((size_t)T * C, 256), 256, 0, sl_stream(g),
		  dwpe, dout, B, T, C);
}
