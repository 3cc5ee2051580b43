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
#include <mma.h>
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

/* ---- column sums over rows, two passes (layernorm's dweight and dbias, matmul's dbias) ----
 * dst_k[c] += sum over the N rows i of term(i, c)[k], k < K (K = 1 or 2 sums), C columns.
 * Pass 1: a grid of (column tiles of SL_COLSUM_COLS) x (row chunks) blocks, each block's
 * SL_COLSUM_LANES row lanes walking its chunk, the lanes then added in lane order; the chunks'
 * partial sums go to the worker's scratch. Pass 2: each column adds its chunks' partials in
 * chunk order into dst. N = 8192 rows of C = 768 make 24 x 64 blocks (one block a column
 * tile before: 24 blocks for 132 SMs). The chunks depend on N, C and K alone (not on the GPU,
 * no atomics): the same bits on every run. One chunk (N <= SL_COLSUM_ROWS): pass 1 adds into
 * dst directly. */
#define SL_COLSUM_COLS 32
#define SL_COLSUM_LANES 8
#define SL_COLSUM_ROWS 128	/* rows a chunk, at least */
#define SL_COLSUM_MAX_CHUNKS 64 /* what pass 2 adds a column, at most */

// part (chunks, K, C) or, with one chunk, dst0/dst1 (C) +=; term(i, c, v) writes v[0..K)
template <int K, class F>
__global__ void sl_colsum_partials(float *part, float *dst0, float *dst1, F term, int N, int C,
				   int rows_per_chunk)
{
	__shared__ float lanes[K][SL_COLSUM_LANES][SL_COLSUM_COLS];
	int tx = threadIdx.x % SL_COLSUM_COLS, ty = threadIdx.x / SL_COLSUM_COLS;
	int c = blockIdx.x * SL_COLSUM_COLS + tx;
	int i0 = blockIdx.y * rows_per_chunk;
	int i1 = N - i0 < rows_per_chunk ? N : i0 + rows_per_chunk;
	float acc[K];
	for (int k = 0; k < K; k++)
		acc[k] = 0.0f;
	if (c < C)
		for (int i = i0 + ty; i < i1; i += SL_COLSUM_LANES) {
			float v[K];
			term(i, c, v);
			for (int k = 0; k < K; k++)
				acc[k] += v[k];
		}
	for (int k = 0; k < K; k++)
		lanes[k][ty][tx] = acc[k];
	__syncthreads();
	if (ty == 0 && c < C)
		for (int k = 0; k < K; k++) {
			float s = acc[k];
			for (int l = 1; l < SL_COLSUM_LANES; l++)
				s += lanes[k][l][tx];
			if (part)
				part[((size_t)blockIdx.y * K + k) * C + c] = s;
			else
				(k == 0 ? dst0 : dst1)[c] += s;
		}
}

// dst_k (C) += the chunks' partials part (chunks, K, C), in chunk order
template <int K>
__global__ void sl_colsum_finish(float *dst0, float *dst1, const float *part, int chunks, int C)
{
	for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x)
		for (int k = 0; k < K; k++) {
			float s = 0.0f;
			for (int j = 0; j < chunks; j++)
				s += part[((size_t)j * K + k) * C + c];
			(k == 0 ? dst0 : dst1)[c] += s;
		}
}

/* The row chunks of a K-sum column reduction over N rows of C columns: as many as give every
 * chunk SL_COLSUM_ROWS rows, at most SL_COLSUM_MAX_CHUNKS and what the scratch holds. */
static inline int sl_colsum_chunks(int N, int C, int K)
{
	size_t fit = SL_GPU_SCRATCH_BYTES / sizeof(float) / ((size_t)K * C);
	size_t n = ((size_t)N + SL_COLSUM_ROWS - 1) / SL_COLSUM_ROWS;
	if (n > SL_COLSUM_MAX_CHUNKS)
		n = SL_COLSUM_MAX_CHUNKS;
	if (n > fit)
		n = fit;
	return n < 1 ? 1 : (int)n;
}

void sl_require_scratch(const struct sl_gpu *g, const char *what);

/* dst0 (C) += column sums of term's first value, dst1 (C) += of its second (K = 2), over N
 * rows: the two passes above, on g's stream and scratch. */
template <int K, class F>
void sl_column_sums(const struct sl_gpu *g, float *dst0, float *dst1, F term, int N, int C)
{
	if (N <= 0 || C <= 0)
		return;
	int chunks = sl_colsum_chunks(N, C, K);
	int rows = (N + chunks - 1) / chunks;
	float *part = NULL;
	if (chunks > 1) {
		sl_require_scratch(g, "column sums");
		part = (float *)g->scratch;
	}
	void (*partials)(float *, float *, float *, F, int, int, int) = sl_colsum_partials<K, F>;
	SL_LAUNCH(partials, dim3((C + SL_COLSUM_COLS - 1) / SL_COLSUM_COLS, chunks),
		  SL_COLSUM_COLS * SL_COLSUM_LANES, 0, sl_stream(g), part, dst0, dst1, term, N, C,
		  rows);
	if (chunks > 1) {
		void (*finish)(float *, float *, const float *, int, int) = sl_colsum_finish<K>;
		SL_LAUNCH(finish, sl_blocks(C, 256), 256, 0, sl_stream(g), dst0, dst1, part, chunks,
			  C);
	}
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
/* The same for `batch` products, the i-th on A[i], B[i], C[i]: arrays of pointers in device
 * memory. */
void sl_gemm_array(const struct sl_gpu *g, cublasOperation_t ta, cublasOperation_t tb, int m,
		   int n, int k, float alpha, const float *const *A, int lda,
		   const float *const *B, int ldb, float beta, float *const *C, int ldc, int batch);

#endif
