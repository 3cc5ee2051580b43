/* The subset of CUDA and cuBLAS that csrc/cuda/<layer>.cu use, run on the CPU: the same kernel
 * sources compiled by g++ (the build's emulated.cpp, meson.build's cuda_src #included into
 * csrc/cuda/emulated.cpp.in) so that the tests check their indexing,
 * reductions and cuBLAS arguments on a machine without a GPU (tests/test_kernels.py, tests/test_model_cuda.py).
 *
 * How it runs: a launch runs its blocks one after another on the calling thread; the threads
 * of a block are cooperative fibers (ucontext) that run until they finish or wait at a
 * barrier (__syncthreads: the block's; __syncwarp and the shuffles: their warp's), resumed
 * in an order that changes from block to block (lane order, reversed, scrambled: a launch's
 * blocks try several) so that a missing barrier reads values not yet written. A __shared__
 * variable is a static: one per kernel, shared by the fibers, in a section of its own that
 * is set to NaN before every block that meets a barrier (as a GPU's shared memory, it holds
 * nothing of another block; g++ 12 ignores the section of a static in a function template,
 * so those of the tensor-core attention and the column sums keep what the block before left:
 * the varied orders are what shows a missing barrier there). Dynamic shared memory and
 * cudaMalloc'ed memory start as NaN, so an element read before it is written shows. Strict
 * where CUDA leaves a program undefined: a thread that exits while others of its block wait
 * at __syncthreads, threads released together from __syncthreads at different call sites
 * (divergent control flow), a shuffle over an exited lane, a WMMA load, store or product not
 * made by every lane of its warp with the same pointer and stride end the program with a
 * message; a launch beyond the grid and block limits or of more than 48 KiB of dynamic
 * shared memory (a GPU takes more only after cudaFuncSetAttribute, which no kernel here
 * calls) fails.
 *
 * cuBLAS: GEMMs in column-major order through the CPU BLAS (cblas), a batched call one product
 * after another (counted as one call, for the tests); TF32 compute rounds
 * every element of A and B to TF32 (10 explicit mantissa bits) to nearest (PTX's
 * cvt.rna.tf32.f32: unit roundoff 2^-11, tests/bounds.py's TF32 bound) before the fp32 GEMM.
 *
 * No cudaMallocAsync: a task's body allocates nothing (the workers' scratch, cuda_kernels.h),
 * and one that did would not compile here. No atomics either: the order of a GPU's atomic
 * additions changes from run to run, and no kernel's may (docs/gpus.md, "Deterministic
 * training"); one that used them would not compile here.
 *
 * Not emulated: concurrency between streams (everything is synchronous), memory spaces
 * (device pointers are host pointers), warp divergence timing, and any floating-point
 * behaviour of the GPU (fast-math intrinsics are the libm functions). */
#ifndef SL_CUDA_EMULATE_H
#define SL_CUDA_EMULATE_H
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

/* ---- launch geometry ---- */
struct dim3 {
	unsigned x, y, z;
	constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace sl_emu {
struct fiber;
extern fiber *current;		/* the thread running now */
extern dim3 block_idx, block_dim, grid_dim;
const dim3 &thread_idx(const fiber *f);
void syncthreads(const char *site);
void syncwarp();
/* shuffles: exchange 8 bytes through the warp's slots between two warp barriers */
uint64_t shuffle(uint64_t v, int src_lane_xor, int src_lane, int delta, int width, int kind);
void *dynamic_shared();
} // namespace sl_emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
/* every __shared__ variable in section sl_emu_shared, which each block starts with as NaN */
#define __shared__ __attribute__((section("sl_emu_shared"))) static
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (sl_emu::thread_idx(sl_emu::current))
#define blockIdx (sl_emu::block_idx)
#define blockDim (sl_emu::block_dim)
#define gridDim (sl_emu::grid_dim)
#define warpSize 32
#define SL_EMU_STR_(x) #x
#define SL_EMU_STR(x) SL_EMU_STR_(x)
/* the call site: the threads a barrier releases must all wait at the same one */
#define __syncthreads() sl_emu::syncthreads(__FILE__ ":" SL_EMU_STR(__LINE__))
#define __syncwarp(...) sl_emu::syncwarp()

namespace sl_emu {
enum { SHFL_XOR, SHFL_DOWN, SHFL_IDX };
template <class T> inline T shfl(T v, int kind, int arg, int width)
{
	static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
	uint64_t bits = 0;
	std::memcpy(&bits, &v, sizeof v);
	bits = shuffle(bits, kind == SHFL_XOR ? arg : 0, kind == SHFL_IDX ? arg : 0,
		       kind == SHFL_DOWN ? arg : 0, width, kind);
	T out;
	std::memcpy(&out, &bits, sizeof out);
	return out;
}
} // namespace sl_emu

template <class T> inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32)
{
	return sl_emu::shfl(v, sl_emu::SHFL_XOR, mask, width);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32)
{
	return sl_emu::shfl(v, sl_emu::SHFL_DOWN, (int)delta, width);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src, int width = 32)
{
	return sl_emu::shfl(v, sl_emu::SHFL_IDX, src, width);
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <class T> inline T __ldg(const T *p) { return *p; }

/* ---- TF32 ---- */
namespace sl_emu {
/* x rounded to TF32 (10 explicit significand bits) to nearest, ties away from zero, as PTX's
 * cvt.rna.tf32.f32: half a TF32 ulp added to the magnitude's bits, the 13 low bits dropped
 * (a carry into the exponent is the correct rounding up); inf and NaN kept */
inline float tf32_round(float x)
{
	uint32_t u;
	std::memcpy(&u, &x, sizeof u);
	if ((u & 0x7f800000u) != 0x7f800000u)
		u = (u + 0x1000u) & 0xffffe000u;
	std::memcpy(&x, &u, sizeof x);
	return x;
}
/* what a tensor core reads of an fp32 register holding a TF32 operand: its 19 high bits (the
 * 13 low ones ignored), so an operand not converted first is truncated */
inline float tf32_truncate(float x)
{
	uint32_t u;
	std::memcpy(&u, &x, sizeof u);
	if ((u & 0x7f800000u) != 0x7f800000u)
		u &= 0xffffe000u;
	std::memcpy(&x, &u, sizeof x);
	return x;
}
/* a WMMA load or store's pointer and stride, as a GPU requires them (CUDA's programming guide,
 * wmma: mptr 256-bit aligned, ldm a multiple of 16 bytes); else the program ends, naming them
 * (on a GPU: a misaligned address fault, or wrong elements) */
void wmma_check(const void *p, unsigned ldm, const char *what);
/* A WMMA call (kind: its name) by the running thread on pointer p, stride ldm, an accumulator's
 * memory layout (NULL, 0, 0: a product), folded into the thread's record of its warp-wide
 * calls, which every lane of a warp must make alike (CUDA: each is made by the whole warp with
 * the same arguments; checked at the block's end). Returns whether the thread is lane 0. */
bool wmma_call(const char *kind, const void *p, unsigned ldm, int layout = 0);
} // namespace sl_emu

/* ---- WMMA (nvcuda::wmma): TF32 m16n16k8 only, what csrc/cuda/attention.cu uses ----
 * A fragment holds its whole tile in every thread, and lane 0's is the warp's: loads, the
 * product and stores act on lane 0's alone (the other lanes' copies are never read; a
 * uniform elementwise pass over x[0..num_elements) touches all, as on a GPU). Which tile
 * element x[i] is, the GPU does not say: here a scramble (row-major element k at
 * x[wmma_slot(k)]), so code that reads x[i] as a given row or column is wrong here too. Memory
 * that other lanes wrote and a load reads needs the __syncwarp a GPU needs: fibers switch
 * only at barriers, and lane 0 may run first. The product reads its TF32 operands as a
 * tensor core does (truncated: tf32_truncate; __float_to_tf32 first, as the kernels do, rounds
 * them) and adds in fp32, k in order. */
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision {
struct tf32 {};
} // namespace precision
enum layout_t { mem_row_major, mem_col_major };

/* where a fragment of n (a power of 2) elements keeps element k of its tile, row-major */
inline int wmma_slot(int k, int n) { return (k * 37 + 11) & (n - 1); }

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment;
template <class Layout> struct fragment<matrix_a, 16, 16, 8, precision::tf32, Layout> {
	enum { rows = 16, cols = 8, num_elements = 16 * 8 };
	float x[num_elements];
};
template <class Layout> struct fragment<matrix_b, 16, 16, 8, precision::tf32, Layout> {
	enum { rows = 8, cols = 16, num_elements = 8 * 16 };
	float x[num_elements];
};
template <> struct fragment<accumulator, 16, 16, 8, float, void> {
	enum { rows = 16, cols = 16, num_elements = 16 * 16 };
	float x[num_elements];
};

inline float __float_to_tf32(float x) { return sl_emu::tf32_round(x); }

template <class F> inline void fill_fragment(F &f, float v)
{
	for (int i = 0; i < F::num_elements; i++)
		f.x[i] = v;
}
/* element (r, c) of a tile at p: row-major p[r ldm + c], column-major p[c ldm + r] */
template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 8, precision::tf32, Layout> &f, const float *p,
			     unsigned ldm)
{
	typedef fragment<Use, 16, 16, 8, precision::tf32, Layout> F;
	if (!sl_emu::wmma_call("load_matrix_sync", p, ldm))
		return;
	sl_emu::wmma_check(p, ldm, "load_matrix_sync"); /* the warp's pointer: once, by its lane 0 */
	const bool row = std::is_same<Layout, row_major>::value;
	for (int r = 0; r < F::rows; r++)
		for (int c = 0; c < F::cols; c++)
			f.x[wmma_slot(r * F::cols + c, F::num_elements)] =
				row ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 8, float> &f, const float *p,
			     unsigned ldm, layout_t layout)
{
	if (!sl_emu::wmma_call("load_matrix_sync", p, ldm, layout))
		return;
	sl_emu::wmma_check(p, ldm, "load_matrix_sync"); /* the warp's pointer: once, by its lane 0 */
	for (int r = 0; r < 16; r++)
		for (int c = 0; c < 16; c++)
			f.x[wmma_slot(r * 16 + c, 256)] = layout == mem_row_major
								  ? p[(size_t)r * ldm + c]
								  : p[(size_t)c * ldm + r];
}
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 8, float> &f,
			      unsigned ldm, layout_t layout)
{
	if (!sl_emu::wmma_call("store_matrix_sync", p, ldm, layout))
		return;
	sl_emu::wmma_check(p, ldm, "store_matrix_sync"); /* the warp's pointer: once, by its lane 0 */
	for (int r = 0; r < 16; r++)
		for (int c = 0; c < 16; c++)
			(layout == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]) =
				f.x[wmma_slot(r * 16 + c, 256)];
}
// d (16,16) = a (16,8) @ b (8,16) + c
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 8, float> &d,
		     const fragment<matrix_a, 16, 16, 8, precision::tf32, LA> &a,
		     const fragment<matrix_b, 16, 16, 8, precision::tf32, LB> &b,
		     const fragment<accumulator, 16, 16, 8, float> &c)
{
	if (!sl_emu::wmma_call("mma_sync", nullptr, 0))
		return;
	float out[16 * 16];
	for (int r = 0; r < 16; r++)
		for (int n = 0; n < 16; n++) {
			float s = c.x[wmma_slot(r * 16 + n, 256)];
			for (int k = 0; k < 8; k++)
				s += sl_emu::tf32_truncate(a.x[wmma_slot(r * 8 + k, 128)]) *
				     sl_emu::tf32_truncate(b.x[wmma_slot(k * 16 + n, 128)]);
			out[wmma_slot(r * 16 + n, 256)] = s;
		}
	std::memcpy(d.x, out, sizeof out);
}
} // namespace wmma
} // namespace nvcuda

/* ---- runtime API ---- */
typedef int cudaError_t;
enum {
	cudaSuccess = 0,
	cudaErrorInvalidValue = 1,
	cudaErrorMemoryAllocation = 2,
	cudaErrorInvalidConfiguration = 9,
	cudaErrorInsufficientDriver = 35,
	cudaErrorNoDevice = 100,
	cudaErrorSystemDriverMismatch = 803,
};
enum cudaMemcpyKind {
	cudaMemcpyHostToHost = 0,
	cudaMemcpyHostToDevice = 1,
	cudaMemcpyDeviceToHost = 2,
	cudaMemcpyDeviceToDevice = 3,
	cudaMemcpyDefault = 4,
};
typedef struct sl_emu_stream *cudaStream_t;
const char *cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
			    cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaGetDeviceCount(int *n);

namespace sl_emu {
/* Runs grid x block threads of body, blocks one after another; smem bytes of dynamic shared
 * memory per block. A bad configuration sets the error cudaGetLastError returns. */
void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t s, const std::function<void()> &body);
/* The block count of every launch since the last call (the first `max` into blocks), and how
 * many there were: the grids a kernel chose, for the tests (sl_gpu_emulated_launches). */
int take_launches(unsigned *blocks, int max);
} // namespace sl_emu

/* ---- cuBLAS ---- */
typedef struct sl_emu_cublas *cublasHandle_t;
typedef int cublasStatus_t;
enum {
	CUBLAS_STATUS_SUCCESS = 0,
	CUBLAS_STATUS_NOT_INITIALIZED = 1,
	CUBLAS_STATUS_INVALID_VALUE = 7,
};
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
			    int n, int k, const void *alpha, const void *A, cudaDataType at,
			    int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
			    void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
			    cublasGemmAlgo_t algo);
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
				   int m, int n, int k, const void *alpha, const void *const A[],
				   cudaDataType at, int lda, const void *const B[],
				   cudaDataType bt, int ldb, const void *beta, void *const C[],
				   cudaDataType ct, int ldc, int batch,
				   cublasComputeType_t compute, cublasGemmAlgo_t algo);

namespace sl_emu {
/* How many cuBLAS GEMM calls (a batched call counts one) since the last call, for the tests
 * (sl_gpu_emulated_blas_calls). */
int take_blas_calls();
} // namespace sl_emu

#endif
