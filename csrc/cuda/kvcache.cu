/* Generation's key/value cache on the rows of a decode step: append each row's key and value
 * into its slot, and the attention of each row's query over its slot (layout and idx (N,3):
 * csrc/kernels/kvcache.c). */
#include "gpu.h"

#define DECODE_THREADS 128
#define DECODE_STATIC_SHARED (32 * sizeof(float)) /* the block reductions' scratch */

// kcache, vcache (S,NH,Tc,hs): row r's k, v of qkv (N,3C) at position idx[r].position of slot
// idx[r].slot; one thread per (row, channel)
static __global__ void kv_append_kernel(float *kcache, float *vcache, const float *qkv,
					const int32_t *idx, int N, int C, int NH, int Tc)
{
	const int hs = C / NH;
	size_t n = (size_t)N * C;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		int r = (int)(i / C), c = (int)(i % C), h = c / hs, d = c % hs;
		const int32_t *x = idx + 3 * (size_t)r;
		const float *src = qkv + (size_t)r * 3 * C;
		size_t dst = (((size_t)x[1] * NH + h) * Tc + x[2]) * hs + d;
		kcache[dst] = src[C + c];
		vcache[dst] = src[2 * C + c];
	}
}

/* One block per (row, head): the scores of keys 0..position of the row's slot (shared
 * memory), their softmax, then each thread one output channel, the weights applied in key
 * order. Causal by construction: a row sees only its slot's positions up to its own. */
static __global__ void attention_decode_kernel(float *out, const float *qkv, const float *kcache,
					       const float *vcache, const int32_t *idx, int C, int NH,
					       int Tc)
{
	__shared__ float scratch[DECODE_STATIC_SHARED / sizeof(float)];
	SL_DYNAMIC_SHARED(float, a);
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);
	int r = blockIdx.x / NH, h = blockIdx.x % NH;
	const int32_t *x = idx + 3 * (size_t)r;
	int n = x[2] + 1;
	const float *q = qkv + (size_t)r * 3 * C + h * hs;
	size_t head = ((size_t)x[1] * NH + h) * Tc * hs;
	const float *k = kcache + head, *v = vcache + head;
	float mx = -INFINITY;
	for (int j = threadIdx.x; j < n; j += blockDim.x) {
		float dot = 0.0f;
		for (int d = 0; d < hs; d++)
			dot += q[d] * k[(size_t)j * hs + d];
		dot *= scale;
		a[j] = dot;
		mx = fmaxf(mx, dot);
	}
	mx = sl_block_max(mx, scratch);
	float sum = 0.0f;
	for (int j = threadIdx.x; j < n; j += blockDim.x) {
		float e = expf(a[j] - mx);
		a[j] = e;
		sum += e;
	}
	float inv = 1.0f / sl_block_sum(sum, scratch);
	for (int j = threadIdx.x; j < n; j += blockDim.x)
		a[j] *= inv;
	__syncthreads();
	float *o = out + (size_t)r * C + h * hs;
	for (int d = threadIdx.x; d < hs; d += blockDim.x) {
		float acc = 0.0f;
		for (int j = 0; j < n; j++)
			acc += a[j] * v[(size_t)j * hs + d];
		o[d] = acc;
	}
}

void kv_append_cuda(const struct sl_gpu *g, float *kcache, float *vcache, const float *qkv,
		    const int32_t *idx, int N, int C, int NH, int Tc)
{
	size_t n = (size_t)N * C;
	if (n)
		SL_LAUNCH(kv_append_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), kcache, vcache,
			  qkv, idx, N, C, NH, Tc);
}

void attention_decode_cuda(const struct sl_gpu *g, float *out, const float *qkv,
			   const float *kcache, const float *vcache, const int32_t *idx, int N,
			   int C, int NH, int Tc)
{
	/* the positions are in idx, on the GPU: room for the scores of a whole slot, beside the
	 * kernel's static scratch (48 KiB a block holds both, without opting in to more) */
	size_t smem = (size_t)Tc * sizeof(float);
	if (smem + DECODE_STATIC_SHARED > 48 * 1024) {
		fprintf(stderr, "starpu_llm: attention_decode_cuda: slots of %d positions need %zu "
				"bytes of shared memory, above 48 KiB\n", Tc, smem + DECODE_STATIC_SHARED);
		abort();
	}
	unsigned blocks = (unsigned)N * NH;
	if (blocks)
		SL_LAUNCH(attention_decode_kernel, blocks, DECODE_THREADS, smem, sl_stream(g), out,
			  qkv, kcache, vcache, idx, C, NH, Tc);
}
