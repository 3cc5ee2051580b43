/* Private to the kernels: an exp() (and a select) that GCC vectorises.
 *
 * Why: without -ffast-math GCC never calls glibc's vector libm, so expf/tanhf stay scalar
 * calls, several times slower per element than a vectorised loop, which would make softmax
 * over 50k columns and GeLU over (B,T,4C) cost a sizeable fraction of a GEMM. This inline
 * version is plain IEEE float arithmetic (no fast-math) and vectorises in `omp simd` loops.
 *
 * Math: x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2; ln2 is split in a high part
 * with few mantissa bits (n * ln2_hi is exact for |n| < 2^8) and a low part (Cody-Waite);
 * e^r by its degree-7 Taylor polynomial (truncation < 2^-27 on |r| <= ln2/2); 2^n built in
 * the exponent bits. Relative error ~2 ulp.
 * Domain: x <= 88. Returns 0 for x < -87 (and -inf), NaN for NaN.
 * It is written without branches or clamps on purpose: GCC turns a clamp into branches
 * (it constant-folds the clamped cases) and then refuses to vectorise the loop. */
#ifndef STARPU_LLM_VEXPF_H
#define STARPU_LLM_VEXPF_H
#include <stdint.h>
#include <string.h>

static inline float vexpf(float x)
{
	const float log2e = 1.44269504088896341f;
	const float ln2_hi = 0.693145751953125f;      /* 15 significant bits */
	const float ln2_lo = 1.42860682030941723e-6f; /* ln2 - ln2_hi */
	/* adding 1.5*2^23 rounds to an integer (round-to-nearest) and leaves that integer in
	 * the low mantissa bits, so n is read from the bits: no float->int conversion */
	const float shifter = 12582912.0f;
	float kf = x * log2e + shifter;
	uint32_t kbits;
	memcpy(&kbits, &kf, sizeof kbits);
	kf -= shifter;
	float r = x - kf * ln2_hi;
	r = r - kf * ln2_lo;
	float p = 1.0f / 5040.0f;
	p = p * r + 1.0f / 720.0f;
	p = p * r + 1.0f / 120.0f;
	p = p * r + 1.0f / 24.0f;
	p = p * r + 1.0f / 6.0f;
	p = p * r + 0.5f;
	p = p * r + 1.0f;
	p = p * r + 1.0f;
	/* 2^n: (n + 127) in the exponent field, kbits - 0x4B400000 being n */
	uint32_t sbits = (kbits - 0x4B400000u + 127u) << 23;
	float scale;
	memcpy(&scale, &sbits, sizeof scale);
	float y = p * scale;
	/* below -87 the bits above are meaningless (n < -126): mask the result to +0 */
	uint32_t ybits;
	memcpy(&ybits, &y, sizeof ybits);
	ybits &= 0u - (uint32_t) !(x < -87.0f);
	memcpy(&y, &ybits, sizeof y);
	return y;
}

/* c ? a : b as bit operations. A plain ?: whose operand is computed only for it (an exp,
 * say) gets sunk into a branch by GCC, and with the default -ftrapping-math the branch is
 * never converted back into a vector blend, so the loop is not vectorised. */
static inline float vselectf(int c, float a, float b)
{
	uint32_t ab, bb, m = 0u - (uint32_t)(c != 0);
	memcpy(&ab, &a, sizeof ab);
	memcpy(&bb, &b, sizeof bb);
	uint32_t rb = (ab & m) | (bb & ~m);
	float r;
	memcpy(&r, &rb, sizeof r);
	return r;
}

#endif
