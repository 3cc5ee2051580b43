/* GeLU, tanh approximation (as GPT-2 / torch gelu(approximate="tanh")). */
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include "vexpf.h"

#define GELU_S 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f

/* tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) in (0, 1]: never overflows */
static inline float tanh_v(float u) {
    float e = vexpf(-2.0f * fabsf(u));
    return copysignf((1.0f - e) / (1.0f + e), u);
}

// out (N), inp (N)
void gelu_forward(float *out, const float *inp, size_t N) {
    #pragma omp parallel for simd schedule(static) if (N > 32768)
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        float t = tanh_v(GELU_S * (x + GELU_A * x * x * x));
        out[i] = 0.5f * x * (1.0f + t);
    }
}

// dinp (N) =, inp (N), dout (N)
void gelu_backward(float *dinp, const float *inp, const float *dout, size_t N) {
    #pragma omp parallel for simd schedule(static) if (N > 32768)
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        float t = tanh_v(GELU_S * (x + GELU_A * x * x * x));
        /* d/dx 0.5 x (1 + tanh u) = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx */
        float du = GELU_S * (1.0f + 3.0f * GELU_A * x * x);
        float g = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
        dinp[i] = g * dout[i];
    }
}
