/* What the GPU kernels share (checks, GEMMs, the workers' scratch) and the small data
 * kernels: zeroing, in-place add (the gradient reduction), copy. */
#include "gpu.h"
#include <stdio.h>
#include <stdlib.h>

void sl_cuda_check(cudaError_t err, const char *call, const char *file, int line)
{
	if (err == cudaSuccess)
		return;
	fprintf(stderr, "starpu_llm: CUDA error %d (%s) in %s at %s:%d\n", (int)err,
		cudaGetErrorString(err), call, file, line);
	abort();
}

void sl_cublas_check(cublasStatus_t st, const char *call, const char *file, int line)
{
	if (st == CUBLAS_STATUS_SUCCESS)
		return;
	fprintf(stderr, "starpu_llm: cuBLAS error %d (%s) in %s at %s:%d\n", (int)st,
		cublasGetStatusString(st), call, file, line);
	abort();
}

void sl_require_scratch(const struct sl_gpu *g, const char *what)
{
	if (g->scratch)
		return;
	fprintf(stderr, "starpu_llm: %s need the CUDA worker's scratch (sl_gpu_scratch_create at "
		"the worker's start), none given\n", what);
	abort();
}

void *sl_gpu_scratch_create(void)
{
	void *p = NULL;
	SL_CUDA_CHECK(cudaMalloc(&p, SL_GPU_SCRATCH_BYTES));
	return p;
}

void sl_gpu_scratch_destroy(void *scratch)
{
	if (scratch)
		SL_CUDA_CHECK(cudaFree(scratch));
}

void sl_gemm(const struct sl_gpu *g, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
	     int k, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
	     float *C, int ldc)
{
	SL_CUBLAS_CHECK(cublasGemmEx(sl_blas(g), ta, tb, m, n, k, &alpha, A, CUDA_R_32F, lda, B,
				     CUDA_R_32F, ldb, &beta, C, CUDA_R_32F, ldc, sl_compute(g),
				     CUBLAS_GEMM_DEFAULT));
}

void sl_gemm_array(const struct sl_gpu *g, cublasOperation_t ta, cublasOperation_t tb, int m,
		   int n, int k, float alpha, const float *const *A, int lda,
		   const float *const *B, int ldb, float beta, float *const *C, int ldc, int batch)
{
	SL_CUBLAS_CHECK(cublasGemmBatchedEx(sl_blas(g), ta, tb, m, n, k, &alpha,
					    (const void *const *)A, CUDA_R_32F, lda,
					    (const void *const *)B, CUDA_R_32F, ldb, &beta,
					    (void *const *)C, CUDA_R_32F, ldc, batch, sl_compute(g),
					    CUBLAS_GEMM_DEFAULT));
}

// dst (n) += src (n)
static __global__ void add_kernel(float *dst, const float *src, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		dst[i] += src[i];
}

// x (n) = 0: all bits zero is +0.0f
void fill_zero_cuda(const struct sl_gpu *g, float *x, size_t n)
{
	SL_CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof *x, sl_stream(g)));
}

void add_inplace_cuda(const struct sl_gpu *g, float *dst, const float *src, size_t n)
{
	if (n)
		SL_LAUNCH(add_kernel, sl_blocks(n, 256), 256, 0, sl_stream(g), dst, src, n);
}

void copy_floats_cuda(const struct sl_gpu *g, float *dst, const float *src, size_t n)
{
	SL_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof *dst, cudaMemcpyDeviceToDevice,
				      sl_stream(g)));
}
