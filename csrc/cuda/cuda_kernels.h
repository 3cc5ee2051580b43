/* The GPT-2 layer kernels on a GPU (csrc/cuda/<layer>.cu), seen from C: what each codelet's CUDA
 * body calls (csrc/codelets/, SL_CUDA). The same maths, shapes and conventions as the CPU
 * kernels of csrc/kernels/kernels.h (each declaration below names its CPU twin), on device
 * memory, queued on the stream of g without waiting for it (a StarPU CUDA task is
 * asynchronous: STARPU_CUDA_ASYNC). Matmuls go through cuBLAS on g's handle, in fp32 or TF32
 * (g->tf32).
 *
 * Where the GPU sums in another order than the CPU (the blocks of a reduction, cuBLAS's
 * GEMMs), results differ by roundings within the fp32 bounds of tests/bounds.py. No kernel
 * uses atomic additions: every one gives the same bits on every run on one GPU model (cuBLAS
 * too, on one stream; docs/gpus.md, "Deterministic training").
 *
 * In the CPU build these are compiled by g++ against a CPU emulation of CUDA and cuBLAS
 * (emulate.h) for the tests. */
#ifndef SL_CUDA_KERNELS_H
#define SL_CUDA_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* Where a GPU body queues its work: the CUDA stream and cuBLAS handle of the StarPU CUDA
 * worker running the task (starpu_cuda_get_local_stream, starpu_cublas_get_local_handle),
 * and the matmul precision: tf32 nonzero lets cuBLAS round the GEMMs' inputs to TF32 (tensor
 * cores), 0 keeps every matmul in fp32. */
struct sl_gpu {
	void *stream;  /* cudaStream_t */
	void *blas;    /* cublasHandle_t */
	int tf32;
	void *scratch; /* SL_GPU_SCRATCH_BYTES of device memory, the worker's own (used in stream
			  order: one stream per worker, so its tasks never overlap on it) */
};

/* The scratch of a CUDA worker (the partial sums of the two-pass reductions), allocated once
 * when the worker starts (sl_gpu_scratch_create on its thread) and freed when it stops: no
 * task allocates device memory. Both end the program on a CUDA error, naming the call. */
#define SL_GPU_SCRATCH_BYTES ((size_t)4 << 20)
void *sl_gpu_scratch_create(void);
void sl_gpu_scratch_destroy(void *scratch);

/* The task trace's GPU times (csrc/starpu/trace.c; the CUDA build only). An event recorded
 * now on stream, made for it, and the device it is on (NULL on a CUDA error, which is taken
 * off the thread: the trace then has no GPU time for that task). */
void *sl_gpu_event_record(void *stream, int *device);
/* The CLOCK_MONOTONIC time (now_ns's) at which each of the n events (of device devices[i])
 * completed, waited for, into ns[i] (0 where an event is NULL or a CUDA call fails); each
 * event destroyed. Against an event recorded on a stream of its own on each device, timed
 * when it completes. Returns the events timed. */
int sl_gpu_event_times(void **events, const int *devices, int n, int64_t (*now_ns)(void),
		       int64_t *ns);

/* The row blocks of a matrix (kernels.h, "Row blocks") handed to a kernel by value: at most
 * SL_GPU_MAX_BLOCKS blocks (a kernel's arguments are copied to the GPU with its launch). */
#define SL_GPU_MAX_BLOCKS 32

/* encoder_forward_blocks, encoder_decode_blocks */
void encoder_forward_cuda(const struct sl_gpu *g, float *out, const int32_t *inp,
			  const float *const *wte, const int *rows, int nb, const float *wpe,
			  int B, int T, int C);
void encoder_decode_cuda(const struct sl_gpu *g, float *out, const int32_t *idx,
			 const float *const *wte, const int *rows, int nb, const float *wpe, int N,
			 int C);
/* encoder_backward_blocks, in its order of additions: the same bits (g's scratch: encoder.cu) */
void encoder_backward_cuda(const struct sl_gpu *g, float *const *dwte, const int *rows, int nb,
			   float *dwpe, const float *dout, const int32_t *inp, int B, int T, int C);

/* layernorm_forward, layernorm_backward */
void layernorm_forward_cuda(const struct sl_gpu *g, float *out, float *mean, float *rstd,
			    const float *inp, const float *weight, const float *bias, int N, int C);
void layernorm_backward_cuda(const struct sl_gpu *g, float *dinp, float *dweight, float *dbias,
			     const float *dout, const float *inp, const float *weight,
			     const float *mean, const float *rstd, int N, int C, int accumulate);

/* matmul_forward_blocks, matmul_backward_blocks */
void matmul_forward_cuda(const struct sl_gpu *g, float *out, const float *inp,
			 const float *const *weight, const int *rows, int nb, const float *bias,
			 int N, int C, int OC);
void matmul_backward_cuda(const struct sl_gpu *g, float *dinp, float *const *dweight,
			  float *dbias, const float *dout, const float *inp,
			  const float *const *weight, const int *rows, int nb, int N, int C, int OC);

/* attention_forward, attention_backward: batched GEMMs (cuBLAS) for the scores and the
 * weighted values, a softmax kernel between them */
void attention_forward_cuda(const struct sl_gpu *g, float *out, float *att, const float *qkv,
			    int B, int T, int C, int NH);
void attention_backward_cuda(const struct sl_gpu *g, float *dqkv, float *dpreatt, float *datt,
			     const float *dout, const float *qkv, const float *att, int B, int T,
			     int C, int NH);
/* attention_flash_forward, attention_flash_backward: fused kernels, no (T, T) tensor */
void attention_flash_forward_cuda(const struct sl_gpu *g, float *out, float *lse,
				  const float *qkv, int B, int T, int C, int NH);
void attention_flash_backward_cuda(const struct sl_gpu *g, float *dqkv, float *dsum,
				   const float *dout, const float *qkv, const float *out,
				   const float *lse, int B, int T, int C, int NH);

/* kv_append, attention_decode */
void kv_append_cuda(const struct sl_gpu *g, float *kcache, float *vcache, const float *qkv,
		    const int32_t *idx, int N, int C, int NH, int Tc);
void attention_decode_cuda(const struct sl_gpu *g, float *out, const float *qkv,
			   const float *kcache, const float *vcache, const int32_t *idx, int N,
			   int C, int NH, int Tc);

/* gelu_forward, gelu_backward, residual_forward */
void gelu_forward_cuda(const struct sl_gpu *g, float *out, const float *inp, size_t N);
void gelu_backward_cuda(const struct sl_gpu *g, float *dinp, const float *inp, const float *dout,
			size_t N);
void residual_forward_cuda(const struct sl_gpu *g, float *out, const float *inp1,
			   const float *inp2, size_t N);

/* crossentropy_softmax_forward, crossentropy_softmax_backward */
void crossentropy_forward_cuda(const struct sl_gpu *g, float *probs, float *losses,
			       const float *logits, const int32_t *targets, int N, int V, int Vp,
			       int accumulate);
void crossentropy_backward_cuda(const struct sl_gpu *g, float *dlogits, const float *probs,
				const int32_t *targets, int N, int V, int Vp, float dloss);

/* adamw_update, with the clipping factor computed on the GPU from the squared norm sumsq
 * (device memory; NULL or max_norm <= 0: no clipping) as clip_scale does; the gradients are
 * zeroed after use */
void adamw_cuda(const struct sl_gpu *g, float *params, float *grads, float *m, float *v, size_t n,
		float lr, float beta1, float beta2, float eps, float weight_decay, int t,
		const double *sumsq, float max_norm);

/* sum_of_squares (fixed blocks into the scratch, then their sum in a fixed order), sum_f64
 * (k device scalars) */
void sum_of_squares_cuda(const struct sl_gpu *g, double *out, const float *x, size_t n);
void sum_f64_cuda(const struct sl_gpu *g, double *out, const double *const *in, int k);

/* fill_zero, add_inplace, copy_floats */
void fill_zero_cuda(const struct sl_gpu *g, float *x, size_t n);
void add_inplace_cuda(const struct sl_gpu *g, float *dst, const float *src, size_t n);
void copy_floats_cuda(const struct sl_gpu *g, float *dst, const float *src, size_t n);

#endif
