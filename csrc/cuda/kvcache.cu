/* Generation's key/value cache: append the new positions, and the attention of the new
 * queries over the cache (layout: csrc/kernels/kvcache.c). */
#include "gpu.h"

#define DECODE_THREADS 128

// kcache, vcache (B,NH,maxT,hs) at positions pos..pos+Tn-1 = k, v of qkv (B,Tn,3C)
static __global__ void kv_append_kernel(float *kcache, float *vcache, const float *qkv, int B,
					int Tn, int C, int NH, int maxT, int pos)
{
	const int hs = C / NH;
	size_t n = (size_t)B * Tn * C;
	for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
	     idx += (size_t)gridDim.x * blockDim.x) {
		int c = (int)(idx % C), bi = (int)(idx / C);
		int b = bi / Tn, i = bi % Tn, h = c / hs, d = c % hs;
		const float *src = qkv + (size_t)bi * 3 * C;
		size_t dst = (((size_t)b * NH + h) * maxT + pos + i) * hs + d;
		kcache[dst] = src[C + c];
		vcache[dst] = src[2 * C + c];
	}
}

/* One block per (b, h, new query i): the scores of keys 0..pos+i (shared memory), their
 * softmax, then each thread one output channel, the weights applied in key order. */
static __global__ void attention_decode_kernel(float *out, const float *qkv, const float *kcache,
					       const float *vcache, int B, int Tn, int C, int NH,
					       int maxT, int pos)
{
	__shared__ float scratch[32];
	SL_DYNAMIC_SHARED(float, a);
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);
	int i = blockIdx.x % Tn, h = (blockIdx.x / Tn) % NH, b = blockIdx.x / (Tn * NH);
	int n = pos + i + 1;
	const float *q = qkv + ((size_t)b * Tn + i) * 3 * C + h * hs;
	size_t headoff = ((size_t)b * NH + h) * maxT * hs;
	const float *k = kcache + headoff, *v = vcache + headoff;
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
	float *o = out + ((size_t)b * Tn + i) * C + h * hs;
	for (int d = threadIdx.x; d < hs; d += blockDim.x) {
		float acc = 0.0f;
		for (int j = 0; j < n; j++)
			acc += a[j] * v[(size_t)j * hs + d];
		o[d] = acc;
	}
}

void kv_append_cuda(const struct sl_gpu *g, float *kcache, float *vcache, const float *qkv, int B,
		    int Tn, int C, int NH, int maxT, int pos)
{
	size_t n = (size_t)B * Tn * C;
	if (n)
		SL_LAUNCH(kv_append_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), kcache, vcache,
			  qkv, B, Tn, C, NH, maxT, pos);
}

void attention_decode_cuda(const struct sl_gpu *g, float *out, const float *qkv,
			   const float *kcache, const float *vcache, int B, int Tn, int C, int NH,
			   int maxT, int pos)
{
	size_t smem = (size_t)(pos + Tn) * sizeof(float); /* the scores of the longest query */
	if (smem > 48 * 1024) {
		fprintf(stderr, "starpu_llm: attention_decode_cuda: %d cached positions need %zu "
				"bytes of shared memory, above 48 KiB\n", pos + Tn, smem);
		abort();
	}
	unsigned blocks = (unsigned)B * NH * Tn;
	if (blocks)
		SL_LAUNCH(attention_decode_kernel, blocks, DECODE_THREADS, smem, sl_stream(g), out,
			  qkv, kcache, vcache, B, Tn, C, NH, maxT, pos);
}
