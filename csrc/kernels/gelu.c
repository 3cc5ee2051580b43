/* GeLU, tanh approximation (as GPT-2 / torch gelu(approximate="tanh")). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include "vexpf.h"

#define GELU_S 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f

/* 0.5 (1 + tanh u) = sigmoid(2u) and 0.5 (1 - tanh u) = sigmoid(-2u), both from
 * e = exp(-2|u|) in (0, 1]: no overflow, and no cancellation in 1 + tanh u for u << 0
 * (where GeLU is tiny and 1 + tanh computed directly would lose all its digits). */
static inline void half_one_pm_tanh(float u, float *sp, float *sn)
{
	float e = vexpf(-2.0f * fabsf(u));
	float r = 1.0f / (1.0f + e);
	int pos = u >= 0.0f;
	*sp = vselectf(pos, 1.0f, e) * r;
	*sn = vselectf(pos, e, 1.0f) * r;
}

// out (N), inp (N)
void gelu_forward(float *out, const float *inp, size_t N)
{
#pragma omp parallel for simd schedule(static) if (N > 32768)
	for (size_t i = 0; i < N; i++) {
		float x = inp[i];
		float sp, sn;
		half_one_pm_tanh(GELU_S * (x + GELU_A * x * x * x), &sp, &sn);
		out[i] = x * sp; // 0.5 x (1 + tanh u)
	}
}

// dinp (N) =, inp (N), dout (N)
void gelu_backward(float *dinp, const float *inp, const float *dout, size_t N)
{
#pragma omp parallel for simd schedule(static) if (N > 32768)
	for (size_t i = 0; i < N; i++) {
		float x = inp[i];
		float sp, sn;
		half_one_pm_tanh(GELU_S * (x + GELU_A * x * x * x), &sp, &sn);
		/* d/dx 0.5 x (1 + tanh u) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx,
		 * with 0.5 (1 - tanh^2 u) = 2 sp sn */
		float du = GELU_S * (1.0f + 3.0f * GELU_A * x * x);
		dinp[i] = (sp + 2.0f * x * sp * sn * du) * dout[i];
	}
}
