/* Private to the kernels: exp(x) for x <= 0 in float64, vectorised by GCC (sample.c's draw).
 * As vexpf.h's float one (that header says why: GCC vectorises it in an `omp simd` loop,
 * where glibc's exp stays a scalar call): x = n ln2 + r, n = round(x / ln2), |r| <= ln2/2, ln2
 * in two parts (Cody-Waite: n * ln2_hi exact for |n| < 2^11); e^r by its degree-13 Taylor
 * polynomial (truncation < 2^-57 on |r| <= ln2/2); 2^n in the exponent bits. Within 1 ulp of
 * glibc's exp on [-708, 0] (tests/test_sample_batch.py checks 2 ulp); 0 below -708 (and for
 * -inf), where glibc's gives subnormals. */
#ifndef STARPU_LLM_VEXP_H
#define STARPU_LLM_VEXP_H
#include <stdint.h>
#include <string.h>

static inline double vexp_neg(double x)
{
	const double log2e = 1.4426950408889634074;
	const double ln2_hi = 6.93147180369123816490e-01; /* fdlibm's: 32 significant bits */
	const double ln2_lo = 1.90821492927058770002e-10; /* ln2 - ln2_hi */
	const double shifter = 6755399441055744.0;	 /* 1.5 * 2^52: n in the low bits */
	double kf = x * log2e + shifter;
	uint64_t kbits;
	memcpy(&kbits, &kf, sizeof kbits);
	kf -= shifter;
	double r = x - kf * ln2_hi;
	r = r - kf * ln2_lo;
	double p = 1.0 / 6227020800.0; /* 1/13! */
	p = p * r + 1.0 / 479001600.0;
	p = p * r + 1.0 / 39916800.0;
	p = p * r + 1.0 / 3628800.0;
	p = p * r + 1.0 / 362880.0;
	p = p * r + 1.0 / 40320.0;
	p = p * r + 1.0 / 5040.0;
	p = p * r + 1.0 / 720.0;
	p = p * r + 1.0 / 120.0;
	p = p * r + 1.0 / 24.0;
	p = p * r + 1.0 / 6.0;
	p = p * r + 0.5;
	p = p * r + 1.0;
	p = p * r + 1.0;
	/* 2^n: (n + 1023) in the exponent field; kbits - the shifter's bits being n */
	uint64_t sbits = (kbits - 0x4338000000000000ull + 1023u) << 52;
	double scale;
	memcpy(&scale, &sbits, sizeof scale);
	double y = p * scale;
	uint64_t ybits;
	memcpy(&ybits, &y, sizeof ybits);
	ybits &= 0ull - (uint64_t) !(x < -708.0);
	memcpy(&y, &ybits, sizeof y);
	return y;
}

#endif
