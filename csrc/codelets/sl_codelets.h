/* The codelet table, seen by Python (the cffi modules are generated from this file): each
 * codelet is declared once, in csrc/codelets/<layer>.c (SL_CODELET in codelet.h), with its
 * buffers and their access modes, its scalar arguments (one struct below), its flop count and
 * its body. Both engines are derived from that one declaration:
 *   - the StarPU engine submits a task of it (csrc/starpu/codelets.c builds the StarPU codelet,
 *     sl_submit in sl_api.h inserts the task);
 *   - the reference engine calls its body at once (sl_codelet_run), with no StarPU loaded.
 * Python reads the table (names, modes, argument struct) and builds one method per codelet
 * (starpu_llm/kernels/codelets.py). No StarPU type appears here. */
#ifndef SL_CODELETS_H
#define SL_CODELETS_H
#include <stddef.h>
#include <stdint.h>

/* ---- the scalar arguments of each codelet (field order = Python's argument order) ---- */
struct sl_no_args {
	int unused;
};
struct sl_encoder_args {
	int B, T, C;
	int blocks; /* wte's row blocks (the repeat count: Python fills it from the call) */
};
struct sl_encoder_decode_args {
	int N, C;
	int blocks; /* wte's row blocks */
};
struct sl_encoder_backward_args {
	int B, T, C;
	int blocks; /* dwte's row blocks */
};
struct sl_layernorm_args {
	int N, C;
};
struct sl_layernorm_backward_args {
	int N, C;
	int accumulate; /* dinp += instead of = (its buffer is then RW, not W) */
};
struct sl_matmul_args {
	int N, C, OC;
	int blocks; /* the weight's row blocks (the tied lm head's wte: its blocks; else 1) */
};
struct sl_attention_args {
	int B, T, C, NH;
};
struct sl_kvcache_args {
	int N, C, NH;
	int Tc; /* positions a cache slot holds */
};
struct sl_elementwise_args {
	size_t N;
};
struct sl_xent_args {
	int N, V, Vp;
	int accumulate; /* losses += instead of = (their buffer is then RW, not W) */
};
struct sl_xent_backward_args {
	int N, V, Vp;
	float dloss;
};
struct sl_adamw_args {
	float lr, beta1, beta2, eps, weight_decay;
	int t;
	float max_norm; /* > 0: clip to it, by the norm in the optional sumsq buffer */
};
struct sl_load_args {
	const uint16_t *tokens; /* the caller keeps the shard alive until the task ran */
	size_t pos, n;
};
struct sl_gather_args {
	char *dst; /* the memory of the first buffer (any data interface), its sources' total */
	int count; /* the sources */
};
struct sl_norm_sum_args {
	int count; /* the inputs */
};
struct sl_probe_args {
	uint64_t *out;
	int max_threads;
};

/* ---- the table ---- */
/* Access modes as bits, for the table, the task trace and Python. */
#define SL_ACCESS_R	   1  /* reads */
#define SL_ACCESS_W	   2  /* writes (W, RW, SCRATCH) */
#define SL_ACCESS_REDUX	   4  /* contributes to a reduction (STARPU_REDUX) */
#define SL_ACCESS_OPTIONAL 8  /* a trailing buffer a task may leave out (matmul's bias) */
#define SL_ACCESS_REPEAT   16 /* k >= 1 of them in its place (norm_sum's inputs, wte's blocks) */
#define SL_ACCESS_ANY	   32 /* any data interface: the body gets no pointer (gather's target) */
#define SL_MAX_BUFFERS	   8  /* declared buffers of a codelet (STARPU_NMAXBUFS of Debian's 1.3) */

int sl_codelet_count(void);
const char *sl_codelet_name(int codelet);      /* "?" for no such codelet */
const char *sl_codelet_args_type(int codelet); /* e.g. "struct sl_matmul_args" */
/* The int field of the arguments counting the repeated buffers ("blocks"; "" without). */
const char *sl_codelet_repeat_field(int codelet);
int sl_codelet_sequential(int codelet);	       /* 1: always on one core; -1: no such codelet */
/* modes[i] (i < max): the SL_ACCESS_* bits of buffer i of a task of codelet submitted with this
 * redux (gradients: STARPU_REDUX instead of RW) and accumulate (W becomes RW), plus
 * OPTIONAL / REPEAT / ANY as declared; returns the declared buffer count (-EINVAL: no such
 * codelet). */
int sl_codelet_modes(int codelet, int redux, int accumulate, int32_t *modes, int max);
/* The flop count of a task of codelet on n buffers of count[i] elements (0: left out). */
double sl_codelet_flops(int codelet, const size_t *count, int n, const void *args);
/* Runs the body of codelet at once in this thread (the reference engine): n buffers at ptr[i]
 * of count[i] elements of elemsize[i] bytes (ptr NULL: an optional buffer left out); args the
 * codelet's argument struct. Returns 0, or -EINVAL for no such codelet / a wrong buffer count. */
int sl_codelet_run(int codelet, void *const *ptr, const size_t *count, const size_t *elemsize,
		   int n, const void *args);

/* ---- the codelets' CUDA bodies (csrc/cuda/run.cu) ---- */
/* 1 when codelet has a CUDA body (SL_CUDA), 0 when its tasks run on CPUs only. */
int sl_codelet_has_cuda(int codelet);
/* Runs the CUDA body of codelet at once on copies of the n host buffers (as sl_codelet_run:
 * ptr NULL for a buffer left out), matmuls in TF32 when tf32, then copies them back: on GPU 0
 * of a CUDA build, in the CPU emulation of CUDA otherwise (sl_gpu_emulated). Returns 0,
 * -EINVAL as sl_codelet_run, -ENOSYS for a codelet without a CUDA body, -ENODEV without a
 * GPU. */
int sl_codelet_run_cuda(int codelet, void *const *ptr, const size_t *count,
			const size_t *elemsize, int n, const void *args, int tf32);
int sl_gpu_emulated(void); /* 1: the CUDA bodies run in the CPU emulation (no CUDA build) */
/* The GPUs CUDA sees: 0 where it finds none (no device, the CPU emulation), -(its cudaError)
 * where it could not count them (a driver older than the build's CUDA, a broken install),
 * which sl_gpu_error_string names: never read as "no GPU". */
int sl_gpu_devices(void);
const char *sl_gpu_error_string(int err); /* cudaGetErrorString(err) */
/* The CUDA this build was compiled with (CUDART_VERSION: 1000 major + 10 minor) and the newest
 * the driver runs (cudaDriverGetVersion; 0: no driver), 0 and 0 in the CPU emulation; device
 * dev's compute capability x10 (90: sm_90), -(its cudaError), -ENODEV in the emulation. */
int sl_gpu_runtime_version(void);
int sl_gpu_driver_version(void);
int sl_gpu_device_cc(int dev);
/* The emulation's launches since the last call: their count, and the block count of each of
 * the first max in blocks (the grids the kernels chose); -ENOSYS in a CUDA build. */
int sl_gpu_emulated_launches(unsigned *blocks, int max);
/* The emulation's cuBLAS GEMM calls since the last call (a batched call counts one); -ENOSYS
 * in a CUDA build. */
int sl_gpu_emulated_blas_calls(void);
/* The matmul precision of the StarPU engine's CUDA tasks: 1 TF32 (the default), 0 fp32. */
void sl_gpu_set_tf32(int tf32);
int sl_gpu_tf32(void);

#endif
