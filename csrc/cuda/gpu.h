/* What every csrc/cuda/<layer>.cu file shares: CUDA and cuBLAS (the real ones, or their CPU
 * emulation, emulate.h, when SL_CUDA_EMULATION is defined: the CPU build's tests), the
 * launch macro, the checks, and the warp and block reductions. */
#ifndef SL_CUDA_GPU_H
#define SL_CUDA_GPU_H
#ifdef SL_CUDA_EMULATION
#include "emulate.h"
#else
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "cuda_kernels.h"
}

/* Ends the program, naming the call, when a CUDA or cuBLAS call fails: a kernel that cannot
 * run leaves the tensors it writes undefined, and a StarPU task has no way to fail. */
void sl_cuda_check(cudaError_t err, const char *call, const char *file, int line);
void sl_cublas_check(cublasStatus_t st, const char *call, const char *file, int line);
#define SL_CUDA_CHECK(call) sl_cuda_check((call), #call, __FILE__, __LINE__)
#define SL_CUBLAS_CHECK(call) sl_cublas_check((call), #call, __FILE__, __LINE__)

/* kernel<<<grid, block, smem, stream>>>(args...), then the launch's error checked */
#ifdef SL_CUDA_EMULATION
#define SL_LAUNCH(kernel, grid, block, smem, stream, ...)                                          \
	do {                                                                                       \
		sl_emu::launch((grid), (block), (smem), (stream), [=]() { kernel(__VA_ARGS__); }); \
		SL_CUDA_CHECK(cudaGetLastError());                                                 \
	} while (0)
#define SL_DYNAMIC_SHARED(type, name) type *name = (type *)sl_emu::dynamic_shared()
#else
#define SL_LAUNCH(kernel, grid, block, smem, stream, ...)                                          \
	do {                                                                                       \
		kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__);                        \
		SL_CUDA_CHECK(cudaGetLastError());                                                 \
	} while (0)
#define SL_DYNAMIC_SHARED(type, name)                                                              \
	extern __shared__ __align__(16) unsigned char sl_dynamic_shared[];                         \
	type *name = (type *)sl_dynamic_shared
#endif

static inline cudaStream_t sl_stream(const struct sl_gpu *g) { return (cudaStream_t)g->stream; }
static inline cublasHandle_t sl_blas(const struct sl_gpu *g) { return (cublasHandle_t)g->blas; }

/* Blocks for n items at `per_block` items a block, at most `cap` (grid-stride loops do the
 * rest; a fixed cap keeps the grid, and so any order of work, independent of the GPU). */
static inline unsigned sl_blocks(size_t n, unsigned per_block, unsigned cap = 8192)
{
	size_t b = (n + per_block - 1) / per_block;
	return (unsigned)(b < 1 ? 1 : b > cap ? cap : b);
}

/* ---- reductions (every lane / thread gets the result; fixed order: deterministic) ---- */
template <class T> __device__ __forceinline__ T sl_warp_sum(T v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

__device__ __forceinline__ float sl_warp_max(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

/* Sum over a block of blockDim.x threads (a multiple of 32, at most 1024), whose every
 * thread calls it; `scratch` holds 32 values of T in shared memory. */
template <class T> __device__ T sl_block_sum(T v, T *scratch)
{
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
	v = sl_warp_sum(v);
	__syncthreads(); /* scratch may still be read from a previous call */
	if (lane == 0)
		scratch[warp] = v;
	__syncthreads();
	T s = lane < nwarps ? scratch[lane] : (T)0;
	return sl_warp_sum(s);
}

__device__ inline float sl_block_max(float v, float *scratch)
{
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
	v = sl_warp_max(v);
	__syncthreads();
	if (lane == 0)
		scratch[warp] = v;
	__syncthreads();
	float m = lane < nwarps ? scratch[lane] : -INFINITY;
	return sl_warp_max(m);
}

/* The compute type of a GEMM at the run's matmul precision (g->tf32). */
static inline cublasComputeType_t sl_compute(const struct sl_gpu *g)
{
	return g->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

/* C = alpha op(A) op(B) + beta C, column-major (cuBLAS's convention), fp32 in and out. */
void sl_gemm(const struct sl_gpu *g, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
	     int k, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
	     float *C, int ldc);
/* The same for `batch` products, the i-th on A + i sA, B + i sB, C + i sC. */
void sl_gemm_batched(const struct sl_gpu *g, cublasOperation_t ta, cublasOperation_t tb, int m,
		     int n, int k, float alpha, const float *A, int lda, long long sA,
		     const float *B, int ldb, long long sB, float beta, float *C, int ldc,
		     long long sC, int batch);

#endif
