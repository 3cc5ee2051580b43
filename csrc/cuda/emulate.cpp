/* The CPU emulation of CUDA and cuBLAS declared in emulate.h (what it does and does not
 * emulate is said there). */
#include "emulate.h"
#include <cblas.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <ucontext.h>
#include <vector>

namespace sl_emu {

enum state { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };

/* Switching between fibers: on x86-64 a few instructions (the callee-saved registers and the
 * stack pointer; a block of 1024 threads meeting many barriers switches millions of times),
 * elsewhere ucontext (which also saves the signal mask: a system call per switch). */
#if defined(__x86_64__)
extern "C" void sl_emu_switch(void **save_sp, void *load_sp);
asm(".text\n"
    ".globl sl_emu_switch\n"
    ".type sl_emu_switch,@function\n"
    "sl_emu_switch:\n"
    "	pushq %rbp\n"
    "	pushq %rbx\n"
    "	pushq %r12\n"
    "	pushq %r13\n"
    "	pushq %r14\n"
    "	pushq %r15\n"
    "	movq %rsp, (%rdi)\n"
    "	movq %rsi, %rsp\n"
    "	popq %r15\n"
    "	popq %r14\n"
    "	popq %r13\n"
    "	popq %r12\n"
    "	popq %rbx\n"
    "	popq %rbp\n"
    "	ret\n"
    ".size sl_emu_switch, .-sl_emu_switch\n");
struct context {
	void *sp;
};
#else
struct context {
	ucontext_t uc;
};
#endif

struct fiber {
	context ctx;
	dim3 tid;
	int linear; /* x + y bx + z bx by */
	int state;
	const char *site; /* the __syncthreads it waits at (WAIT_BLOCK) */
	uint64_t wmma;	  /* its WMMA calls so far in the block, hashed (wmma_call) */
};

fiber *current;
dim3 block_idx, block_dim, grid_dim;

static context scheduler;
static std::vector<fiber> fibers;
static std::vector<char *> stacks;
static const size_t STACK = 64 * 1024;
static const std::function<void()> *body;
static std::vector<uint64_t> slots; /* one 8-byte slot per thread, for the shuffles */
static std::vector<unsigned char> dyn_shared;
static cudaError_t last_error = cudaSuccess;
static std::mutex one_launch; /* the statics above serve one launch at a time */
/* A launch whose first block never waits at a barrier runs its other blocks' threads as
 * plain calls, one after another (most element-wise kernels: no context switch); a barrier
 * met there ends the program rather than run wrongly. */
static bool direct, waited;

[[noreturn]] static void fail(const char *what)
{
	fprintf(stderr, "starpu_llm CUDA emulation: %s (block %u,%u,%u thread %u,%u,%u)\n", what,
		block_idx.x, block_idx.y, block_idx.z, current ? current->tid.x : 0,
		current ? current->tid.y : 0, current ? current->tid.z : 0);
	abort();
}

void wmma_check(const void *p, unsigned ldm, const char *what)
{
	char msg[160];
	if ((uintptr_t)p % 32 != 0) {
		snprintf(msg, sizeof msg, "wmma::%s at %p: the pointer must be 256-bit aligned", what, p);
		fail(msg);
	}
	if (ldm % 4 != 0) {
		snprintf(msg, sizeof msg, "wmma::%s with ldm %u: a multiple of 4 floats (16 bytes) is required",
			 what, ldm);
		fail(msg);
	}
}

const dim3 &thread_idx(const fiber *f)
{
	if (!f)
		fail("threadIdx read outside a kernel");
	return f->tid;
}

/* from the running fiber `from` (or the scheduler) to `to` */
static void switch_to(context *from, context *to)
{
#if defined(__x86_64__)
	sl_emu_switch(&from->sp, to->sp);
#else
	if (swapcontext(&from->uc, &to->uc) != 0)
		fail("swapcontext failed");
#endif
}

static void wait(int st)
{
	if (direct)
		fail("a barrier in a block run without fibers (the launch's first block met none)");
	waited = true;
	fiber *me = current;
	me->state = st;
	switch_to(&me->ctx, &scheduler);
}

void syncthreads(const char *site)
{
	if (current)
		current->site = site;
	wait(WAIT_BLOCK);
}

void syncwarp() { wait(WAIT_WARP); }

uint64_t shuffle(uint64_t v, int lane_xor, int src_lane, int delta, int width, int kind)
{
	int me = current->linear, lane = me % 32, base = me - lane;
	if (width < 1 || width > 32 || (width & (width - 1)))
		fail("shuffle width must be a power of two <= 32");
	slots[me] = v;
	wait(WAIT_WARP); /* every lane has written its slot */
	int seg = lane & ~(width - 1), src;
	if (kind == SHFL_XOR)
		src = seg + ((lane ^ lane_xor) & (width - 1));
	else if (kind == SHFL_IDX)
		src = seg + (src_lane & (width - 1));
	else
		src = (lane - seg) + delta < width ? lane + delta : lane;
	if (base + src >= (int)fibers.size())
		fail("shuffle from a lane past the block");
	uint64_t out = slots[base + src];
	wait(WAIT_WARP); /* every lane has read before a slot is written again */
	return out;
}

void *dynamic_shared() { return dyn_shared.data(); }

/* FNV-1a over n bytes, continuing h */
static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
	return h;
}

bool wmma_call(const char *kind, const void *p, unsigned ldm, int layout)
{
	fiber *me = current;
	if (!me)
		fail("a WMMA call outside a kernel");
	uint64_t h = fnv(me->wmma, kind, strlen(kind));
	h = fnv(h, &p, sizeof p);
	h = fnv(h, &ldm, sizeof ldm);
	me->wmma = fnv(h, &layout, sizeof layout);
	return me->linear % 32 == 0;
}

/* At a block's end: every lane of each warp made the same WMMA calls (count, kinds, pointers,
 * strides, layouts), as CUDA requires of warp-wide calls; else the program ends. */
static void check_wmma(int nthreads)
{
	for (int w = 0; w < nthreads; w += 32)
		for (int i = w + 1; i < nthreads && i < w + 32; i++)
			if (fibers[i].wmma != fibers[w].wmma) {
				current = &fibers[i];
				fail("a WMMA load, store or product not made by every lane of the warp "
				     "with the same pointer, stride and layout (lane 0's calls differ "
				     "from this thread's)");
			}
}

/* The static __shared__ variables (emulate.h: section sl_emu_shared; the linker defines these
 * bounds of a section named as a C identifier; weak: none in a program without one) */
extern "C" char __start_sl_emu_shared[] __attribute__((weak));
extern "C" char __stop_sl_emu_shared[] __attribute__((weak));

/* a block's static shared memory as NaN, as nothing of the block before it is left */
static void poison_static_shared()
{
	if (__start_sl_emu_shared && __stop_sl_emu_shared > __start_sl_emu_shared)
		memset(__start_sl_emu_shared, 0xff,
		       (size_t)(__stop_sl_emu_shared - __start_sl_emu_shared));
}

static void trampoline()
{
	(*body)();
	current->state = DONE;
#if defined(__x86_64__)
	switch_to(&current->ctx, &scheduler); /* never resumed */
	abort();
#endif
	/* (ucontext) returning resumes uc_link: the scheduler */
}

/* f set to start trampoline() on its own stack */
static void prepare(fiber &f, char *stack)
{
#if defined(__x86_64__)
	/* as if sl_emu_switch had saved it: six registers, then trampoline as the return address,
	 * the stack 16-byte aligned at trampoline's entry minus its return address */
	uintptr_t top = ((uintptr_t)(stack + STACK)) & ~(uintptr_t)15;
	void **sp = (void **)(top - 64);
	for (int i = 0; i < 6; i++)
		sp[i] = nullptr;
	sp[6] = (void *)trampoline;
	sp[7] = nullptr;
	f.ctx.sp = sp;
#else
	if (getcontext(&f.ctx.uc) != 0)
		fail("getcontext failed");
	f.ctx.uc.uc_stack.ss_sp = stack;
	f.ctx.uc.uc_stack.ss_size = STACK;
	f.ctx.uc.uc_link = &scheduler.uc;
	makecontext(&f.ctx.uc, trampoline, 0);
#endif
}

/* The order in which block `block` (its linear index in the grid) runs its n fibers between
 * barriers: lane order, the reverse, or one of several scrambled ones, in turn from block to
 * block, so that a launch of a few blocks tries each (a missing barrier then reads unwritten
 * data whichever thread the kernel expects first). The same on every run. */
static void order(std::vector<int> &o, int n, unsigned block)
{
	o.resize(n);
	for (int i = 0; i < n; i++)
		o[i] = block % 4 == 2 ? n - 1 - i : i;
	if (block % 4 == 1 || block % 4 == 2)
		return;
	uint32_t r = 2463534242u ^ (block * 2654435761u);
	for (int i = n - 1; i > 0; i--) {
		r ^= r << 13;
		r ^= r >> 17;
		r ^= r << 5;
		int j = (int)(r % (uint32_t)(i + 1));
		int t = o[i];
		o[i] = o[j];
		o[j] = t;
	}
}

static void run_block(int nthreads, const std::vector<int> &ord)
{
	for (int i = 0; i < nthreads; i++) {
		fiber &f = fibers[i];
		f.linear = i;
		f.tid = dim3(i % block_dim.x, (i / block_dim.x) % block_dim.y,
			     i / (block_dim.x * block_dim.y));
		f.state = RUNNABLE;
		f.site = nullptr;
		f.wmma = 0;
		prepare(f, stacks[i]);
	}
	int done = 0;
	while (done < nthreads) {
		int ran = 0;
		for (int k = 0; k < nthreads; k++) {
			fiber &f = fibers[ord[k]];
			if (f.state != RUNNABLE)
				continue;
			current = &f;
			switch_to(&scheduler, &f.ctx);
			ran++;
			if (f.state == DONE)
				done++;
		}
		current = nullptr;
		if (done == nthreads)
			break;
		/* every live thread waits: release a barrier */
		int at_block = 0, released = 0;
		for (int i = 0; i < nthreads; i++)
			at_block += fibers[i].state == WAIT_BLOCK;
		if (at_block > 0 && at_block + done == nthreads) {
			if (done > 0)
				fail("__syncthreads with exited threads in the block");
			/* one barrier for all: a __syncthreads in divergent code is undefined */
			for (int i = 1; i < nthreads; i++)
				if (fibers[i].site != fibers[0].site &&
				    strcmp(fibers[i].site, fibers[0].site) != 0) {
					char msg[320];
					snprintf(msg, sizeof msg, "__syncthreads at %s met by thread %d "
						 "while thread 0 waits at %s (divergent barriers)",
						 fibers[i].site, i, fibers[0].site);
					current = &fibers[i];
					fail(msg);
				}
			for (int i = 0; i < nthreads; i++)
				fibers[i].state = RUNNABLE;
			continue;
		}
		for (int w = 0; w < nthreads; w += 32) {
			int end = w + 32 < nthreads ? w + 32 : nthreads, waiting = 0, exited = 0;
			for (int i = w; i < end; i++) {
				waiting += fibers[i].state == WAIT_WARP;
				exited += fibers[i].state == DONE;
			}
			if (waiting > 0 && waiting + exited == end - w) {
				if (exited > 0)
					fail("warp barrier or shuffle with exited lanes");
				for (int i = w; i < end; i++)
					fibers[i].state = RUNNABLE;
				released++;
			}
		}
		if (!released && !ran)
			fail("deadlock: the threads wait at barriers that cannot all be reached");
		if (!released)
			fail("deadlock: threads wait at __syncthreads while others wait in a warp");
	}
	check_wmma(nthreads);
}

static std::vector<unsigned> launches; /* the blocks of each launch since the last read */

int take_launches(unsigned *blocks, int max)
{
	std::lock_guard<std::mutex> lock(one_launch);
	int n = (int)launches.size();
	for (int i = 0; i < n && i < max; i++)
		blocks[i] = launches[i];
	launches.clear();
	return n;
}

void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, const std::function<void()> &fn)
{
	size_t nthreads = (size_t)block.x * block.y * block.z;
	if (nthreads == 0 || nthreads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
	    grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
		last_error = cudaErrorInvalidConfiguration;
		return;
	}
	if (smem > 48 * 1024) { /* a GPU's limit without cudaFuncSetAttribute's opt-in */
		last_error = cudaErrorInvalidValue;
		return;
	}
	std::lock_guard<std::mutex> lock(one_launch);
	launches.push_back(grid.x * grid.y * grid.z);
	while (stacks.size() < nthreads) {
		char *s = (char *)malloc(STACK);
		if (!s)
			fail("no memory for a thread's stack");
		stacks.push_back(s);
	}
	fibers.resize(nthreads);
	slots.assign(nthreads, 0);
	body = &fn;
	grid_dim = grid;
	block_dim = block;
	std::vector<int> ord;
	waited = direct = false;
	for (unsigned z = 0; z < grid.z; z++)
		for (unsigned y = 0; y < grid.y; y++)
			for (unsigned x = 0; x < grid.x; x++) {
				block_idx = dim3(x, y, z);
				order(ord, (int)nthreads, x + grid.x * (y + grid.y * z));
				dyn_shared.assign(smem, 0xff); /* NaN as floats */
				if (!direct) {
					poison_static_shared();
					run_block((int)nthreads, ord);
					direct = !waited;
					continue;
				}
				for (int k = 0; k < (int)nthreads; k++) {
					fiber &f = fibers[ord[k]];
					f.linear = ord[k];
					f.tid = dim3(f.linear % block.x, (f.linear / block.x) % block.y,
						     f.linear / (block.x * block.y));
					f.wmma = 0;
					current = &f;
					fn();
				}
				current = nullptr;
				check_wmma((int)nthreads);
			}
	direct = false;
	body = nullptr;
}

} // namespace sl_emu

/* ---- runtime API ---- */
const char *cudaGetErrorString(cudaError_t err)
{
	switch (err) {
	case cudaSuccess:
		return "no error";
	case cudaErrorInvalidValue:
		return "invalid argument";
	case cudaErrorMemoryAllocation:
		return "out of memory";
	case cudaErrorInvalidConfiguration:
		return "invalid configuration argument";
	case cudaErrorInsufficientDriver:
		return "CUDA driver version is insufficient for CUDA runtime version";
	case cudaErrorNoDevice:
		return "no CUDA-capable device is detected";
	case cudaErrorSystemDriverMismatch:
		return "system has unsupported display driver / cuda driver combination";
	default:
		return "unknown error";
	}
}

cudaError_t cudaGetLastError(void)
{
	cudaError_t e = sl_emu::last_error;
	sl_emu::last_error = cudaSuccess;
	return e;
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
	*p = malloc(bytes ? bytes : 1);
	if (!*p)
		return cudaErrorMemoryAllocation;
	memset(*p, 0xff, bytes); /* NaN as floats: a read before a write shows */
	return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
	free(p);
	return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind)
{
	if (bytes && (!dst || !src))
		return cudaErrorInvalidValue;
	memmove(dst, src, bytes);
	return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
			    cudaStream_t)
{
	return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t)
{
	if (bytes && !p)
		return cudaErrorInvalidValue;
	memset(p, value, bytes);
	return cudaSuccess;
}

struct sl_emu_stream {
	int unused;
};

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
	*s = new sl_emu_stream();
	return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
	delete s;
	return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

/* no device, as a machine without a GPU; SL_EMULATE_DEVICE_COUNT_ERROR=N: CUDA's error N
 * instead, as a broken or mismatched driver answers (the tests' stand-in for one) */
cudaError_t cudaGetDeviceCount(int *n)
{
	const char *err = getenv("SL_EMULATE_DEVICE_COUNT_ERROR");
	*n = 0;
	return err && *err ? (cudaError_t)atoi(err) : cudaErrorNoDevice;
}

/* ---- cuBLAS ---- */
struct sl_emu_cublas {
	cudaStream_t stream;
};

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
	*h = new sl_emu_cublas();
	return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
	delete h;
	return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s)
{
	if (!h)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	h->stream = s;
	return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
	return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" :
	       s == CUBLAS_STATUS_NOT_INITIALIZED ? "CUBLAS_STATUS_NOT_INITIALIZED" :
						    "CUBLAS_STATUS_INVALID_VALUE";
}

/* A (rows x cols, column-major, ld) copied with every element in TF32 */
static std::vector<float> tf32_copy(const float *A, int rows, int cols, int ld)
{
	std::vector<float> out((size_t)ld * (cols > 0 ? cols - 1 : 0) + rows);
	for (int j = 0; j < cols; j++)
		for (int i = 0; i < rows; i++)
			out[(size_t)j * ld + i] = sl_emu::tf32_round(A[(size_t)j * ld + i]);
	return out;
}

static cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
			   float alpha, const float *A, int lda, const float *B, int ldb,
			   float beta, float *C, int ldc, cublasComputeType_t compute)
{
	int arows = ta == CUBLAS_OP_N ? m : k, acols = ta == CUBLAS_OP_N ? k : m;
	int brows = tb == CUBLAS_OP_N ? k : n, bcols = tb == CUBLAS_OP_N ? n : k;
	if (m < 0 || n < 0 || k < 0 || lda < (arows > 1 ? arows : 1) ||
	    ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1))
		return CUBLAS_STATUS_INVALID_VALUE;
	if (m == 0 || n == 0)
		return CUBLAS_STATUS_SUCCESS;
	std::vector<float> a, b;
	if (compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
		a = tf32_copy(A, arows, acols, lda);
		b = tf32_copy(B, brows, bcols, ldb);
		A = a.data();
		B = b.data();
	} else if (compute != CUBLAS_COMPUTE_32F) {
		return CUBLAS_STATUS_INVALID_VALUE;
	}
	cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
		    tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, alpha, A, lda, B, ldb,
		    beta, C, ldc);
	return CUBLAS_STATUS_SUCCESS;
}

static int blas_calls; /* cuBLAS GEMM calls since the last take_blas_calls */

int sl_emu::take_blas_calls()
{
	int n = blas_calls;
	blas_calls = 0;
	return n;
}

/* one product of a GEMM call: the types checked, then gemm */
static cublasStatus_t gemm_ex(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
			      const void *alpha, const void *A, cudaDataType at, int lda,
			      const void *B, cudaDataType bt, int ldb, const void *beta, void *C,
			      cudaDataType ct, int ldc, cublasComputeType_t compute)
{
	if (at != CUDA_R_32F || bt != CUDA_R_32F || ct != CUDA_R_32F)
		return CUBLAS_STATUS_INVALID_VALUE;
	return gemm(ta, tb, m, n, k, *(const float *)alpha, (const float *)A, lda,
		    (const float *)B, ldb, *(const float *)beta, (float *)C, ldc, compute);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
			    int n, int k, const void *alpha, const void *A, cudaDataType at,
			    int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
			    void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
			    cublasGemmAlgo_t)
{
	if (!h)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	blas_calls++;
	return gemm_ex(ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute);
}

/* cuBLAS's batched GEMM: the products C[i] = alpha op(A[i]) op(B[i]) + beta C[i], i < batch,
 * each as cublasGemmEx (same m, n, k, ops, leading dimensions and compute type); the pointer
 * arrays live in device memory (here: the host's), as the kernels wrote them */
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
				   int m, int n, int k, const void *alpha, const void *const A[],
				   cudaDataType at, int lda, const void *const B[],
				   cudaDataType bt, int ldb, const void *beta, void *const C[],
				   cudaDataType ct, int ldc, int batch,
				   cublasComputeType_t compute, cublasGemmAlgo_t)
{
	if (!h)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	if (batch < 0 || (batch > 0 && (!A || !B || !C)))
		return CUBLAS_STATUS_INVALID_VALUE;
	/* strict where cuBLAS cannot check: the pointer arrays are in device memory, so its
	 * batched kernels take every matrix 16-byte aligned (attention.cu's att_aligned) */
	for (int i = 0; i < batch; i++)
		if ((uintptr_t)A[i] % 16 || (uintptr_t)B[i] % 16 || (uintptr_t)C[i] % 16) {
			fprintf(stderr, "emulated cublasGemmBatchedEx: matrix %d of %d not 16-byte "
					"aligned\n", i, batch);
			return CUBLAS_STATUS_INVALID_VALUE;
		}
	blas_calls++;
	for (int i = 0; i < batch; i++) {
		cublasStatus_t s = gemm_ex(ta, tb, m, n, k, alpha, A[i], at, lda, B[i], bt, ldb,
					   beta, C[i], ct, ldc, compute);
		if (s != CUBLAS_STATUS_SUCCESS)
			return s;
	}
	return CUBLAS_STATUS_SUCCESS;
}
