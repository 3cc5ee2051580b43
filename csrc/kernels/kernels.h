/* Pure GPT-2 layer kernels: C + OpenMP, no StarPU.
 *
 * Conventions (as in llm.c's CPU trainer, but written from the math):
 *   B batch, T sequence length, C channels, NH heads, V real vocabulary, Vp padded
 *   vocabulary (row stride of wte/logits), OC output channels.
 *   All tensors are dense row-major float32; token ids are int32.
 *   Every *_backward ACCUMULATES (+=) into parameter gradients (dweight, dbias, dwte, dwpe),
 *   because gradients of one step are summed over layers that share a tensor (tied wte) and
 *   over sub-batches. Gradients of activations are WRITTEN (=) unless stated otherwise.
 *   Parallel loops use the OpenMP team size of the calling thread (omp_get_max_threads());
 *   the StarPU codelets set it to the cores of the worker that runs the task. Gradient sums
 *   split channels (not rows) over threads: no races, and results do not depend on the team
 *   size.
 *   Unless stated otherwise, outputs do not alias inputs. C % NH == 0; token ids in [0, V).
 */
#ifndef STARPU_LLM_KERNELS_H
#define STARPU_LLM_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* Row blocks: a (rows, C) matrix may be given as nb contiguous blocks of its rows, block b
 * holding rows[b] rows at blk[b] (the rows sum to the matrix's); nb = 1 is the whole matrix
 * (blk[0], rows[0] = its rows). The tied wte is split so across ranks, each block owned by one. */

/* out (B,T,C) = wte[inp[b,t]] + wpe[t];  inp (B,T) int32, wte (Vp,C), wpe (maxT,C) */
void encoder_forward(float *out, const int32_t *inp, const float *wte, const float *wpe, int B,
		     int T, int C);
/* The same with wte (Vp,C) in nb row blocks: the same additions, whatever the blocks. */
void encoder_forward_blocks(float *out, const int32_t *inp, const float *const *wte,
			    const int *rows, int nb, const float *wpe, int B, int T, int C);
/* dwte += scatter of dout by token id, dwpe[t] += sum_b dout[b,t] */
void encoder_backward(float *dwte, float *dwpe, const float *dout, const int32_t *inp, int B, int T,
		      int C);
/* The same with dwte (Vp,C) in nb row blocks: the same additions in the same order. */
void encoder_backward_blocks(float *const *dwte, const int *rows, int nb, float *dwpe,
			     const float *dout, const int32_t *inp, int B, int T, int C);

/* out (N,C) = (inp - mean) * rstd * weight + bias, eps 1e-5; mean, rstd (N) are saved.
 * N = B*T rows. */
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
		       const float *bias, int N, int C);
/* dinp (N,C) = (accumulate ? dinp : 0) + d/dinp; dweight, dbias (C) += */
void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
			const float *inp, const float *weight, const float *mean, const float *rstd,
			int N, int C, int accumulate);

/* out (N,OC) = inp (N,C) @ weight(OC,C)^T + bias (OC); bias may be NULL. cblas_sgemm, or
 * with N <= SL_MATMUL_FEW_ROWS (decoding) a kernel that streams the weight once (matmul.c). */
#define SL_MATMUL_FEW_ROWS 16
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC);
/* The same with weight in nb row blocks: out's columns of block b (leading dimension OC) =
 * inp @ weight_b^T, one sgemm per block (nb = 1: matmul_forward's). */
void matmul_forward_blocks(float *out, const float *inp, const float *const *weight,
			   const int *rows, int nb, const float *bias, int N, int C, int OC);
/* dinp (N,C) = dout @ weight (written, not accumulated);
 * dweight (OC,C) += dout^T @ inp;  dbias (OC) += column sums of dout (dbias may be NULL). */
void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
		     const float *weight, int N, int C, int OC);
/* The same with weight and dweight in the same nb row blocks: dinp = the sum over the blocks
 * of dout's columns of block b @ weight_b (the blocks' sgemms added in block order), dweight_b
 * += (dout's columns of block b)^T @ inp (nb = 1: matmul_backward's sgemms). */
void matmul_backward_blocks(float *dinp, float *const *dweight, float *dbias, const float *dout,
			    const float *inp, const float *const *weight, const int *rows, int nb,
			    int N, int C, int OC);

/* Causal self-attention over qkv (B,T,3C) laid out [q | k | v] per token, heads of size
 * hs = C/NH. att (B,NH,T,T): the softmax of the scores scaled by 1/sqrt(hs) (entries above the
 * diagonal are written as 0). out (B,T,C). */
void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH);
/* dqkv (B,T,3C) written; dpreatt, datt (B,NH,T,T) are scratch (written below the diagonal);
 * dout (B,T,C); qkv, att as the forward's. */
void attention_backward(float *dqkv, float *dpreatt, float *datt, const float *dout,
			const float *qkv, const float *att, int B, int T, int C, int NH);
/* The same attention fused (flash.c says how): no (T, T) tensor. The forward writes out
 * and lse (B,NH,T), each query row's log(sum_j exp(score_j)); the backward reads them back,
 * dsum (B,NH,T) its scratch. Keys go in tiles of SL_FLASH_TILE (the CUDA kernels' too). */
#define SL_FLASH_TILE 32
/* The CUDA kernels' largest head size (a row's q and accumulators live in registers; GPT-2's
 * is 64 at every size); the CPU twin takes any. */
#define SL_FLASH_MAX_HS 64
void attention_flash_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
			     int NH);
void attention_flash_backward(float *dqkv, float *dsum, const float *dout, const float *qkv,
			      const float *out, const float *lse, int B, int T, int C, int NH);

/* Generation with a key/value cache in slots (kvcache.c). Per layer, kcache and vcache
 * (S,NH,Tc,hs): slot s holds the keys and values of the positions its sequence has processed.
 * A decode step brings N rows, row r a new position of one sequence: idx (N,3) int32 =
 * (token, slot, position), its [q | k | v] in qkv (N,3C). The rows of one slot in a step have
 * distinct positions, each below Tc; rows come in any order. */
/* Writes each row's key and value into its slot at its position (the others are kept). */
void kv_append(float *kcache, float *vcache, const float *qkv, const int32_t *idx, int N, int C,
	       int NH, int Tc);
/* out (N,C): row r, at position p of slot s, attends to positions 0..p of slot s, as row p of
 * attention_forward over its sequence (call kv_append first). */
void attention_decode(float *out, const float *qkv, const float *kcache, const float *vcache,
		      const int32_t *idx, int N, int C, int NH, int Tc);
/* out (N,C) = wte[token] + wpe[position] of each row of idx (N,3); wte (Vp,C) in nb row blocks */
void encoder_decode_blocks(float *out, const int32_t *idx, const float *const *wte,
			   const int *rows, int nb, const float *wpe, int N, int C);

/* The next token of n sequences (sample.c): row i of the logits, rows[i] of a matrix with
 * leading dimension ld given as float (x32) or double (x64, the other NULL), its V entries
 * finite, drawn from softmax(logits / temperature[i]) (temperature > 0) kept to the top_k[i]
 * largest logits (0: all; ties by id) and to the nucleus of top_p[i] (1: all; the fewest
 * tokens in decreasing probability, ties by id, whose probabilities add up to top_p),
 * renormalised: tokens[i] is the first token whose cumulative probability (in id order)
 * passes u[i] (a uniform draw in [0, 1)) times the total, as numpy's Generator.choice.
 * Rows go to `threads` OpenMP threads (the caller's cores; no BLAS). tokens[i] = -2 where
 * its scratch (3 V doubles a thread) could not be allocated. */
void sample_rows(int64_t *tokens, const float *x32, const double *x64, size_t ld,
		 const int64_t *rows, int n, int V, const double *temperature,
		 const int64_t *top_k, const double *top_p, const double *u, int threads);

/* GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); N elements. */
void gelu_forward(float *out, const float *inp, size_t N);
/* dinp = gelu'(inp) * dout (written) */
void gelu_backward(float *dinp, const float *inp, const float *dout, size_t N);

/* out = inp1 + inp2 (N elements) */
void residual_forward(float *out, const float *inp1, const float *inp2, size_t N);

/* Softmax over the first V of Vp logits of each of the N = B*T rows, then cross-entropy
 * against targets (N). probs (N,Vp): columns >= V are written as 0. losses (N) per row,
 * written, or added into when accumulate (the micro-batches of a gradient accumulation sum
 * their losses there). The mean loss is the caller's sum(losses)/N. */
void crossentropy_softmax_forward(float *probs, float *losses, const float *logits,
				  const int32_t *targets, int N, int V, int Vp, int accumulate);
/* dlogits (N,Vp) = (probs - onehot(targets)) * dloss, dloss the same for every row
 * (1/(B*T) for a mean loss); padded columns written as 0. dlogits may alias probs. */
void crossentropy_softmax_backward(float *dlogits, const float *probs, const int32_t *targets,
				   int N, int V, int Vp, float dloss);

/* AdamW on n parameters, as llm.c and torch.optim.AdamW (decoupled weight decay), on the
 * gradient g = grad_scale * grads (1: as is; gradient clipping passes clip_scale below):
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   p -= lr * ( (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + wd p )
 * t is the 1-based step. If zero_grad, grads is set to 0 after use (ready for the next step).
 * The betas are floats, as in llm.c: v differs from torch's (double 1-beta2) by ~1e-5
 * relative, which the bias correction cancels in the update itself. */
void adamw_update(float *params, float *grads, float *m, float *v, size_t n, float lr, float beta1,
		  float beta2, float eps, float weight_decay, int t, int zero_grad,
		  float grad_scale);

/* Global gradient norm for clipping (as torch.nn.utils.clip_grad_norm_), in three steps:
 * out (1) = sum of x (n)^2, one tensor's partial sum, accumulated in double over fixed blocks
 * (the result does not depend on the team size); */
void sum_of_squares(double *out, const float *x, size_t n);
/* out (1) = x[0] + ... + x[n-1] in this order (partial sums into their total); */
void sum_f64(double *out, const double *x, int n);
/* the factor applied to every gradient: min(1, max_norm / (sqrt(sumsq) + 1e-6)). */
float clip_scale(double sumsq, float max_norm);

/* Zero n floats (used as the StarPU reduction init and for scratch). */
void fill_zero(float *x, size_t n);
/* dst += src (n floats): the StarPU reduction of gradient copies. */
void add_inplace(float *dst, const float *src, size_t n);
/* dst = src (n floats): a tensor handed from one pipeline stage to the next. */
void copy_floats(float *dst, const float *src, size_t n);
/* Load one batch: inputs[i] = tokens[pos+i], targets[i] = tokens[pos+i+1] for i < n
 * (reads the n+1 tokens from pos). */
void load_batch(int32_t *inputs, int32_t *targets, const uint16_t *tokens, size_t pos, size_t n);

/* Freed blocks of up to 32 MB stay in the process (glibc's malloc: not handed to mmap, and the
 * top of the heap trimmed only beyond 256 MB), so that memory allocated and freed at every step
 * (a decode step's logits, a few MB) is not faulted in again at the next: the decoders call it
 * (flow/batch.SlotDecoder). Elsewhere than glibc, nothing. */
void keep_freed_memory(void);

/* The threads of the kernels called next from this thread: its OpenMP team size and the BLAS
 * threads (set together; a k-core task, or the reference loop, calls this with k). */
void kernels_set_threads(int k);
int kernels_threads(void);
void blas_set_threads(int k); /* BLAS alone (a parallel worker's team is sized by StarPU) */
const char *blas_name(void);  /* e.g. "openblas-openmp (Haswell)" */

#endif
