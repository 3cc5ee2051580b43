/* GeLU, tanh approximation (as GPT-2 / torch gelu(approximate="tanh")), element-wise. */
#include "gpu.h"

#define GELU_S 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f

/* With u = S (x + A x^3): 0.5 (1 + tanh u) = sigmoid(2u) and 0.5 (1 - tanh u) = sigmoid(-2u),
 * both from e = exp(-2|u|) in (0, 1]: no overflow, and no cancellation in 1 + tanh u for
 * u << 0, where GeLU is tiny (the CPU kernel's formulation, csrc/kernels/gelu.c). */
static __device__ __forceinline__ void half_one_pm_tanh(float x, float *sp, float *sn)
{
	float u = GELU_S * (x + GELU_A * x * x * x);
	float e = expf(-2.0f * fabsf(u));
	float r = 1.0f / (1.0f + e);
	*sp = (u >= 0.0f ? 1.0f : e) * r;
	*sn = (u >= 0.0f ? e : 1.0f) * r;
}

// out (N) = x (1 + tanh u) / 2, inp (N)
static __global__ void gelu_forward_kernel(float *out, const float *inp, size_t N)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < N;
	     i += (size_t)gridDim.x * blockDim.x) {
		float x = inp[i], sp, sn;
		half_one_pm_tanh(x, &sp, &sn);
		out[i] = x * sp;
	}
}

// dinp (N) = gelu'(inp) dout
static __global__ void gelu_backward_kernel(float *dinp, const float *inp, const float *dout,
					    size_t N)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < N;
	     i += (size_t)gridDim.x * blockDim.x) {
		float x = inp[i], sp, sn;
		half_one_pm_tanh(x, &sp, &sn);
		/* d/dx x (1 + tanh u) / 2 = (1 + tanh u) / 2 + x (1 - tanh^2 u) / 2 du/dx, with
		 * (1 - tanh^2 u) / 2 = 2 sp sn */
		float du = GELU_S * (1.0f + 3.0f * GELU_A * x * x);
		dinp[i] = (sp + 2.0f * x * sp * sn * du) * dout[i];
	}
}

void gelu_forward_cuda(const struct sl_gpu *g, float *out, const float *inp, size_t N)
{
	if (N)
		SL_LAUNCH(gelu_forward_kernel, sl_blocks(N, 256), 256, 0, sl_stream(g), out, inp,
			  N);
}

void gelu_backward_cuda(const struct sl_gpu *g, float *dinp, const float *inp, const float *dout,
			size_t N)
{
	if (N)
		SL_LAUNCH(gelu_backward_kernel, sl_blocks(N, 256), 256, 0, sl_stream(g), dinp,
			  inp, dout, N);
}
