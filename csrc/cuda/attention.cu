/* Causal multi-head self-attention, two ways.
 *
 * Batched GEMMs (attention_forward/backward_cuda, the reference): each product is one cuBLAS
 * call over the B x NH (sequence, head) pairs (attention_gemm below): the scores scale q k^T
 * into att, a softmax kernel in place (causal mask, att above the diagonal written 0, as the
 * CPU kernel does), and out = att v. Row-major (r, c) with leading dimension ld is, to cuBLAS
 * (column-major), its transpose (c, r): each product is written for the transposes below.
 * The full T x T products are computed; the mask zeroes the upper triangle, whose products
 * then add exact zeros. */
#include "gpu.h"
extern "C" {
#include "../kernels/kernels.h" /* SL_FLASH_TILE: the CPU twin's tiles */
}

#define ROWS_PER_BLOCK 8 /* softmax kernels: a warp per row */

/* Rows r of (B*NH*T, T): the query is t = r % T and sees keys 0..t.
 * att holds scale q.k for every key, replaced by the softmax over keys 0..t; 0 beyond t. */
static __global__ void attention_softmax_kernel(float *att, int rows, int T)
{
	int lane = threadIdx.x % 32;
	for (int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; r < rows;
	     r += gridDim.x * ROWS_PER_BLOCK) {
		float *pre = att + (size_t)r * T, *a = pre;
		int t = r % T;
		float mx = -INFINITY;
		for (int j = lane; j <= t; j += 32)
			mx = fmaxf(mx, pre[j]);
		mx = sl_warp_max(mx);
		float sum = 0.0f;
		for (int j = lane; j <= t; j += 32) {
			float e = expf(pre[j] - mx);
			a[j] = e;
			sum += e;
		}
		float inv = 1.0f / sl_warp_sum(sum);
		for (int j = lane; j < T; j += 32) {
			if (j <= t)
				a[j] *= inv;
			else
				a[j] = 0.0f;
		}
	}
}

/* Softmax backward on rows r of (B*NH*T, T): dp = att (datt - sum(att datt)) over keys 0..t
 * (the score scaling is applied by the GEMMs that use dp); dp and datt 0 beyond t. */
static __global__ void attention_softmax_backward_kernel(float *dpreatt, float *datt,
							 const float *att, int rows, int T)
{
	int lane = threadIdx.x % 32;
	for (int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; r < rows;
	     r += gridDim.x * ROWS_PER_BLOCK) {
		const float *a = att + (size_t)r * T;
		float *da = datt + (size_t)r * T, *dp = dpreatt + (size_t)r * T;
		int t = r % T;
		float s = 0.0f;
		for (int j = lane; j <= t; j += 32)
			s += a[j] * da[j];
		s = sl_warp_sum(s);
		for (int j = lane; j < T; j += 32) {
			if (j <= t) {
				dp[j] = a[j] * (da[j] - s);
			} else {
				da[j] = 0.0f;
				dp[j] = 0.0f;
			}
		}
	}
}

static unsigned softmax_blocks(int rows) { return sl_blocks((size_t)rows, ROWS_PER_BLOCK, 65535); }

/* One call per product over the B x NH (b, h) pairs: cublasGemmBatchedEx on device arrays of
 * B NH pointers per operand, because q, k, v are read in place in qkv (B, T, 3C), heads hs
 * floats apart and sequences T 3C apart, which no single stride of a strided-batched call
 * walks (that needs T 3C = NH hs). A task's arrays, one per operand (5 forward, 10 backward),
 * are written by one small kernel into the worker's scratch, in stream order before the GEMMs
 * that read them (and after the previous task's, which read the last ones). A product with
 * a matrix not 16-byte aligned (att_aligned) goes one GEMM a pair instead. */
#define ATT_ARRAYS 10 /* pointer arrays of one task, at most: the backward's operands */

/* the operand of pair (b, h) at base + b seq + h head */
struct att_operand {
	const float *base;
	long long seq, head;
};
struct att_operands {
	att_operand op[ATT_ARRAYS];
	int n;
};

// ptrs (ops.n, pairs): ptrs[i][b NH + h] = the i-th operand of (b, h); pairs = B NH
static __global__ void attention_pointers_kernel(const float **ptrs, att_operands ops,
						 int pairs, int NH)
{
	for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < ops.n * pairs;
	     e += gridDim.x * blockDim.x) {
		const att_operand o = ops.op[e / pairs];
		const int b = e % pairs / NH, h = e % NH;
		ptrs[e] = o.base + b * o.seq + h * o.head;
	}
}

/* The pointer arrays of ops for B x NH pairs, built in g's scratch: array i at the result
 * + i B NH. */
static const float *const *attention_pointers(const struct sl_gpu *g, const att_operands &ops,
					      int B, int NH)
{
	const int pairs = B * NH;
	sl_require_scratch(g, "the batched-GEMM attention's pointer arrays");
	if ((size_t)ops.n * pairs * sizeof(float *) > SL_GPU_SCRATCH_BYTES) {
		fprintf(stderr, "starpu_llm: the batched-GEMM attention takes B x NH up to %zu "
				"pairs, not %d x %d (use the fused attention or a smaller batch)\n",
			SL_GPU_SCRATCH_BYTES / sizeof(float *) / ops.n, B, NH);
		abort();
	}
	const float **ptrs = (const float **)g->scratch;
	SL_LAUNCH(attention_pointers_kernel, sl_blocks((size_t)ops.n * pairs, 256), 256, 0,
		  sl_stream(g), ptrs, ops, pairs, NH);
	return ptrs;
}

/* Whether every matrix of operand o over B x NH pairs starts 16-byte aligned: the batched
 * GEMM reads its pointers on the GPU, where cuBLAS cannot check them, and its kernels load 16
 * bytes at a time. Not always so: the scores' pairs are T T floats apart (T odd: not a
 * multiple of 4), a head hs floats (hs = C / NH need not be one either). */
static bool att_aligned(const att_operand &o, int B, int NH)
{
	return (uintptr_t)o.base % 16 == 0 && (B == 1 || o.seq % 4 == 0) &&
	       (NH == 1 || o.head % 4 == 0);
}

/* C_p = alpha op(A_p) op(B_p) for every pair p, the operands the arrays a, b, c of ptrs (ops
 * on the host); one batched call when every matrix is aligned, else one GEMM a pair (cuBLAS
 * sees those pointers and picks kernels that fit them) */
static void attention_gemm(const struct sl_gpu *g, const att_operands &ops,
			   const float *const *ptrs, int B, int NH, int a, int b, int c,
			   cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
			   float alpha, int lda, int ldb, int ldc)
{
	const int pairs = B * NH;
	const att_operand &A = ops.op[a], &Bo = ops.op[b], &Co = ops.op[c];
	if (att_aligned(A, B, NH) && att_aligned(Bo, B, NH) && att_aligned(Co, B, NH)) {
		sl_gemm_array(g, ta, tb, m, n, k, alpha, ptrs + (size_t)a * pairs, lda,
			      ptrs + (size_t)b * pairs, ldb, 0.0f,
			      (float *const *)(ptrs + (size_t)c * pairs), ldc, pairs);
		return;
	}
	for (int bb = 0; bb < B; bb++)
		for (int h = 0; h < NH; h++)
			sl_gemm(g, ta, tb, m, n, k, alpha, A.base + bb * A.seq + h * A.head, lda,
				Bo.base + bb * Bo.seq + h * Bo.head, ldb, 0.0f,
				(float *)(Co.base + bb * Co.seq + h * Co.head), ldc);
}

// out (B,T,C), att (B,NH,T,T), qkv (B,T,3C) = [q | k | v] per token
void attention_forward_cuda(const struct sl_gpu *g, float *out, float *att, const float *qkv,
			    int B, int T, int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int C3 = 3 * C, hs = C / NH;
	const long long seq = (long long)T * C3, TT = (long long)T * T;
	const float scale = 1.0f / sqrtf((float)hs);
	enum { Q, K, V, ATT, OUT };
	const att_operands ops = { { { qkv, seq, hs },
				     { qkv + C, seq, hs },
				     { qkv + 2 * C, seq, hs },
				     { att, NH * TT, TT },
				     { out, (long long)T * C, hs } },
				   5 };
	const float *const *p = attention_pointers(g, ops, B, NH);
	/* att[t][j] = scale q_t . k_j: att^T (T, T) = k (T, hs) @ q^T (hs, T) */
	attention_gemm(g, ops, p, B, NH, K, Q, ATT, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, C3, C3, T);
	int rows = B * NH * T;
	SL_LAUNCH(attention_softmax_kernel, softmax_blocks(rows), 32 * ROWS_PER_BLOCK, 0,
		  sl_stream(g), att, rows, T);
	/* out_t = sum_j att[t][j] v_j: out^T (hs, T) = v^T (hs, T) @ att^T (T, T) */
	attention_gemm(g, ops, p, B, NH, V, ATT, OUT, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, C3, T, C);
}

// dqkv (B,T,3C) =, dpreatt (B,NH,T,T) =, datt (B,NH,T,T) =, dout (B,T,C), qkv, att
void attention_backward_cuda(const struct sl_gpu *g, float *dqkv, float *dpreatt, float *datt,
			     const float *dout, const float *qkv, const float *att, int B, int T,
			     int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int C3 = 3 * C, hs = C / NH;
	const long long seq = (long long)T * C3, TT = (long long)T * T;
	const float scale = 1.0f / sqrtf((float)hs);
	enum { Q, K, V, DY, ATT, DATT, DP, DQ, DK, DV };
	const att_operands ops = { { { qkv, seq, hs },
				     { qkv + C, seq, hs },
				     { qkv + 2 * C, seq, hs },
				     { dout, (long long)T * C, hs },
				     { att, NH * TT, TT },
				     { datt, NH * TT, TT },
				     { dpreatt, NH * TT, TT },
				     { dqkv, seq, hs },
				     { dqkv + C, seq, hs },
				     { dqkv + 2 * C, seq, hs } },
				   10 };
	const float *const *p = attention_pointers(g, ops, B, NH);
	/* datt[t][j] = dy_t . v_j: datt^T (T, T) = v (T, hs) @ dy^T (hs, T) */
	attention_gemm(g, ops, p, B, NH, V, DY, DATT, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, C3, C, T);
	/* dv_j = sum_t att[t][j] dy_t: dv^T (hs, T) = dy^T (hs, T) @ att (T, T) */
	attention_gemm(g, ops, p, B, NH, DY, ATT, DV, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, C, T, C3);
	int rows = B * NH * T;
	SL_LAUNCH(attention_softmax_backward_kernel, softmax_blocks(rows), 32 * ROWS_PER_BLOCK, 0,
		  sl_stream(g), dpreatt, datt, att, rows, T);
	/* dq_t = scale sum_j dp[t][j] k_j: dq^T (hs, T) = k^T (hs, T) @ dp^T (T, T) */
	attention_gemm(g, ops, p, B, NH, K, DP, DQ, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, scale, C3, T, C3);
	/* dk_j = scale sum_t dp[t][j] q_t: dk^T (hs, T) = q^T (hs, T) @ dp (T, T) */
	attention_gemm(g, ops, p, B, NH, Q, DP, DK, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, scale, C3, T, C3);
}

/* ---- Fused (attention_flash_forward/backward_cuda): no (T, T) tensor in global memory ----
 * The algorithm is csrc/kernels/flash.c's (FlashAttention, Dao et al. 2022, in
 * FlashAttention-2's loop order), row by row in the same tile order: a block of FLASH_ROWS
 * threads takes FLASH_ROWS consecutive rows of one (b, h), one row per thread (its q, its
 * running max, sum and output in registers), and the tiles of SL_FLASH_TILE keys (or, for dk
 * and dv, queries) it walks are staged in shared memory by all its threads, read by every
 * thread at the same address (a broadcast). fp32 FMAs on CUDA cores, fp32 accumulation. What
 * tensor cores would add: a warp computing a tile's q k^T and p v (and the backward's four
 * products) as mma.sync m16n8k8 in TF32, ~8x the fp32 FMA rate, with a 16-row slab per warp
 * instead of a row per thread; the online softmax between the two products stays as here.
 * The backward is deterministic: dq per query row, dk and dv per key row, each written by
 * the one thread that owns it (dk/dv: two threads a key row, one each; no atomics), the
 * scores recomputed in each pass. */
#define FLASH_ROWS 64 /* rows per block: a multiple of SL_FLASH_TILE */
#define FLASH_HS SL_FLASH_MAX_HS /* the largest head size (kernels.h) */

static __device__ __forceinline__ int flash_min(int a, int b) { return a < b ? a : b; }

static void flash_check(int hs)
{
	if (hs > FLASH_HS) {
		/* refused before any task (flow/handles.py): reached only by a direct call */
		fprintf(stderr, "starpu_llm: the fused attention takes head sizes up to %d, not %d "
				"(use the batched-GEMM attention)\n", FLASH_HS, hs);
		abort();
	}
}

/* (b, h) along x, up to 2^31 - 1 of them (y and z stop at 65535, which B NH passes from
 * B = 5462 at GPT-2's 12 heads), the row tiles along y */
static dim3 flash_grid(int B, int T, int NH)
{
	return dim3((unsigned)(B * NH), (unsigned)((T + FLASH_ROWS - 1) / FLASH_ROWS));
}

/* Stages rows r0 .. r0 + SL_FLASH_TILE - 1 (those below T) of an hs-wide slice x of a
 * (T, ld) matrix into shared a, the block's threads side by side along the rows. */
static __device__ void flash_stage(float (*a)[FLASH_HS], const float *x, size_t ld, int r0,
				   int T, int hs)
{
	for (int e = threadIdx.x; e < SL_FLASH_TILE * hs; e += blockDim.x) {
		int j = e / hs, i = e % hs;
		if (r0 + j < T)
			a[j][i] = x[(size_t)(r0 + j) * ld + i];
	}
}

// out (B,T,C), lse (B,NH,T), qkv (B,T,3C); grid (B NH, T / FLASH_ROWS), block FLASH_ROWS
static __global__ void __launch_bounds__(FLASH_ROWS)
	attention_flash_forward_kernel(float *out, float *lse, const float *qkv, int T, int C,
				       int NH, float scale)
{
	__shared__ float ks[SL_FLASH_TILE][FLASH_HS], vs[SL_FLASH_TILE][FLASH_HS];
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int t0 = blockIdx.y * FLASH_ROWS, t = t0 + threadIdx.x;
	const int last = flash_min(t0 + FLASH_ROWS, T) - 1; /* the block's last query */
	const bool live = t < T;
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	float q[FLASH_HS], o[FLASH_HS], s[SL_FLASH_TILE];
#pragma unroll
	for (int i = 0; i < FLASH_HS; i++) {
		q[i] = live && i < hs ? head[(size_t)t * C3 + i] : 0.0f;
		o[i] = 0.0f;
	}
	float m = -INFINITY, l = 0.0f;
	// causal: the key tiles up to the block's last query; each row uses keys 0..t
	for (int j0 = 0; j0 <= last; j0 += SL_FLASH_TILE) {
		flash_stage(ks, head + C, C3, j0, T, hs);
		flash_stage(vs, head + 2 * C, C3, j0, T, hs);
		__syncthreads();
		if (live && j0 <= t) {
			const int n = flash_min(SL_FLASH_TILE, t + 1 - j0);
			float mt = m;
#pragma unroll
			for (int j = 0; j < SL_FLASH_TILE; j++) {
				if (j < n) {
					float dot = 0.0f;
#pragma unroll
					for (int i = 0; i < FLASH_HS; i++)
						if (i < hs)
							dot += q[i] * ks[j][i];
					s[j] = dot * scale;
					mt = fmaxf(mt, s[j]);
				}
			}
			const float corr = j0 == 0 ? 0.0f : expf(m - mt);
			float sum = 0.0f;
#pragma unroll
			for (int j = 0; j < SL_FLASH_TILE; j++) {
				if (j < n) {
					s[j] = expf(s[j] - mt);
					sum += s[j];
				}
			}
			l = l * corr + sum;
#pragma unroll
			for (int i = 0; i < FLASH_HS; i++)
				o[i] *= corr;
#pragma unroll
			for (int j = 0; j < SL_FLASH_TILE; j++) {
				if (j < n) {
#pragma unroll
					for (int i = 0; i < FLASH_HS; i++)
						if (i < hs)
							o[i] += s[j] * vs[j][i];
				}
			}
			m = mt;
		}
		__syncthreads(); /* the next tile overwrites ks, vs */
	}
	if (live) {
		float *y = out + ((size_t)b * T + t) * C + h * hs;
#pragma unroll
		for (int i = 0; i < FLASH_HS; i++)
			if (i < hs)
				y[i] = o[i] / l;
		lse[(size_t)bh * T + t] = m + logf(l);
	}
}

/* dsum (B,NH,T) = dout . out per row: sum_j att[t][j] (dy_t . v_j), the softmax backward's
 * row sum; rows r = (b NH + h) T + t, a warp per row */
static __global__ void attention_flash_dsum_kernel(float *dsum, const float *dout,
						   const float *out, int rows, int T, int C, int NH)
{
	const int lane = threadIdx.x % 32, hs = C / NH;
	for (int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; r < rows;
	     r += gridDim.x * ROWS_PER_BLOCK) {
		const int t = r % T, bh = r / T, b = bh / NH, h = bh % NH;
		const size_t at = ((size_t)b * T + t) * C + h * hs;
		float d = 0.0f;
		for (int i = lane; i < hs; i += 32)
			d += dout[at + i] * out[at + i];
		d = sl_warp_sum(d);
		if (lane == 0)
			dsum[r] = d;
	}
}

/* dq (the q part of dqkv) per query row over its key tiles: a = exp(scale q.k - lse),
 * da = dy . v, dq += scale a (da - dsum) k */
static __global__ void __launch_bounds__(FLASH_ROWS)
	attention_flash_dq_kernel(float *dqkv, const float *dsum, const float *dout,
				  const float *qkv, const float *lse, int T, int C, int NH,
				  float scale)
{
	__shared__ float ks[SL_FLASH_TILE][FLASH_HS], vs[SL_FLASH_TILE][FLASH_HS];
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int t0 = blockIdx.y * FLASH_ROWS, t = t0 + threadIdx.x;
	const int last = flash_min(t0 + FLASH_ROWS, T) - 1;
	const bool live = t < T;
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	const float *dyp = dout + ((size_t)b * T + t) * C + h * hs;
	float q[FLASH_HS], dy[FLASH_HS], dq[FLASH_HS];
#pragma unroll
	for (int i = 0; i < FLASH_HS; i++) {
		q[i] = live && i < hs ? head[(size_t)t * C3 + i] : 0.0f;
		dy[i] = live && i < hs ? dyp[i] : 0.0f;
		dq[i] = 0.0f;
	}
	const float lt = live ? lse[(size_t)bh * T + t] : 0.0f;
	const float dt = live ? dsum[(size_t)bh * T + t] : 0.0f;
	for (int j0 = 0; j0 <= last; j0 += SL_FLASH_TILE) {
		flash_stage(ks, head + C, C3, j0, T, hs);
		flash_stage(vs, head + 2 * C, C3, j0, T, hs);
		__syncthreads();
		if (live && j0 <= t) {
			const int n = flash_min(SL_FLASH_TILE, t + 1 - j0);
			for (int j = 0; j < n; j++) {
				float dot = 0.0f, da = 0.0f;
#pragma unroll
				for (int i = 0; i < FLASH_HS; i++) {
					if (i < hs) {
						dot += q[i] * ks[j][i];
						da += dy[i] * vs[j][i];
					}
				}
				const float g = scale * (expf(dot * scale - lt) * (da - dt));
#pragma unroll
				for (int i = 0; i < FLASH_HS; i++)
					if (i < hs)
						dq[i] += g * ks[j][i];
			}
		}
		__syncthreads();
	}
	if (live) {
		float *d = dqkv + ((size_t)b * T + t) * C3 + h * hs;
#pragma unroll
		for (int i = 0; i < FLASH_HS; i++)
			if (i < hs)
				d[i] = dq[i];
	}
}

/* dk, dv (the k and v parts of dqkv) per key row j over the query tiles from j's on (the
 * queries t >= j see it): dv += a dy_t, dk += scale a (da - dsum_t) q_t. Two threads a key
 * row, side by side in a warp: the even one holds k and sums dv, the odd one holds v and
 * sums dk, the odd one reading a from its pair through a shuffle (one thread holding all
 * four rows, 4 x 64 floats, took 255 registers and spilled: ptxas, docs/gpus.md). A warp
 * walks the queries from its first key row's on, a row adding only those t >= j (the
 * shuffle wants the warp's lanes together). */
#define FLASH_DKV_THREADS (2 * FLASH_ROWS)
static __global__ void __launch_bounds__(FLASH_DKV_THREADS)
	attention_flash_dkv_kernel(float *dqkv, const float *dsum, const float *dout,
				   const float *qkv, const float *lse, int T, int C, int NH,
				   float scale)
{
	__shared__ float qs[SL_FLASH_TILE][FLASH_HS], dys[SL_FLASH_TILE][FLASH_HS];
	__shared__ float ls[SL_FLASH_TILE], ds[SL_FLASH_TILE];
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int j0 = blockIdx.y * FLASH_ROWS, j = j0 + threadIdx.x / 2;
	const int jw = j0 + threadIdx.x / 32 * 16; /* the warp's first key row */
	const bool kt = threadIdx.x % 2 == 0, live = j < T; /* the row's k thread (else v) */
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	const float *row = head + (size_t)j * C3 + (kt ? C : 2 * C);
	float x[FLASH_HS], acc[FLASH_HS]; /* k, dv (k thread) or v, dk (v thread) */
#pragma unroll
	for (int i = 0; i < FLASH_HS; i++) {
		x[i] = live && i < hs ? row[i] : 0.0f;
		acc[i] = 0.0f;
	}
	// the query tiles from the block's first key (j0, a multiple of SL_FLASH_TILE) to T
	for (int t0 = j0; t0 < T; t0 += SL_FLASH_TILE) {
		flash_stage(qs, head, C3, t0, T, hs);
		flash_stage(dys, dout + (size_t)b * T * C + h * hs, C, t0, T, hs);
		for (int e = threadIdx.x; e < SL_FLASH_TILE; e += blockDim.x) {
			if (t0 + e < T) {
				ls[e] = lse[(size_t)bh * T + t0 + e];
				ds[e] = dsum[(size_t)bh * T + t0 + e];
			}
		}
		__syncthreads();
		if (jw < T && t0 + SL_FLASH_TILE > jw) {
			const int n = flash_min(SL_FLASH_TILE, T - t0);
			const float (*y)[FLASH_HS] = kt ? qs : dys, (*z)[FLASH_HS] = kt ? dys : qs;
			for (int e = jw > t0 ? jw - t0 : 0; e < n; e++) {
				const bool on = live && t0 + e >= j;
				float dot = 0.0f; /* k.q_t (k thread), v.dy_t = da (v thread) */
#pragma unroll
				for (int i = 0; i < FLASH_HS; i++)
					if (i < hs)
						dot += y[e][i] * x[i];
				const float a = kt && on ? expf(dot * scale - ls[e]) : 0.0f;
				const float ap = __shfl_xor_sync(0xffffffffu, a, 1); /* the pair's */
				if (on) {
					const float w = kt ? a : scale * (ap * (dot - ds[e]));
#pragma unroll
					for (int i = 0; i < FLASH_HS; i++)
						if (i < hs)
							acc[i] += w * z[e][i];
				}
			}
		}
		__syncthreads();
	}
	if (live) {
		float *d = dqkv + ((size_t)b * T + j) * C3 + (kt ? 2 * C : C) + h * hs;
#pragma unroll
		for (int i = 0; i < FLASH_HS; i++)
			if (i < hs)
				d[i] = acc[i];
	}
}

/* ---- The fused attention on tensor cores (TF32: the matmuls' --gpu-matmul tf32) ----
 * The same algorithm, tiles and roundings of the softmax as the kernels above (the key tiles
 * of SL_FLASH_TILE, the online softmax's running max and sum per row in fp32), with its four
 * products (q k^T, p v; the backward's dy v^T, ds k, p^T dy, ds^T q) as warp-wide TF32 MMAs
 * (WMMA m16n16k8: operands converted to TF32 to nearest, fp32 accumulation), the scalar
 * FMAs above doing 1/20 of the GPU's fp32 rate on an H200 (docs/gpus.md). A block is
 * TC_WARPS warps of 16 rows each (TC_ROWS consecutive rows of one (b, h); dk/dv: two warps
 * each 16); each warp keeps its 16 rows' q (or k, or v) in registers, the tile of keys (or
 * queries) is staged in shared memory by the whole block, and the products go through a
 * per-warp shared scratch, where two lanes a row (dk/dv: four) apply the softmax (a WMMA
 * accumulator's layout is the GPU's own). Head sizes: multiples of 8 up to FLASH_HS,
 * computed in HS = that rounded up to 16 columns (the extra ones staged as 0, never written
 * out); others run the kernels above. Deterministic: no atomics, fixed orders. */
#define TC_WARPS 4
#define TC_ROWS (16 * TC_WARPS)
#define TC_TILE SL_FLASH_TILE	      /* keys (or queries) a tile: 32 */
#define TC_LD (FLASH_HS + 4)	      /* a staged row's stride: WMMA's ldm, a multiple of 4 */
#define TC_SLD (TC_TILE + 4)	      /* the scratch's stride */
static_assert(TC_TILE == 32, "two 16-column MMA tiles a tile, 16 scores a lane");
static_assert(2 * TC_TILE * TC_LD >= TC_ROWS * TC_LD, "the block's rows stage through a tile pair");

namespace wmma = nvcuda::wmma;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> tc_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> tc_b;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> tc_bt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> tc_acc;

template <class F> static __device__ __forceinline__ void tc_round(F &f)
{
#pragma unroll
	for (int i = 0; i < F::num_elements; i++)
		f.x[i] = wmma::__float_to_tf32(f.x[i]);
}

/* rows r0 .. r0 + n - 1 of an hs-wide slice x of a (T, ld) matrix into a (n, TC_LD) shared
 * array, in TF32 (every staged value is an MMA operand: converted once here, not by every
 * warp at every load): rows from T on and columns hs .. HS - 1 as 0 */
template <int HS>
static __device__ void tc_stage(float *a, const float *x, size_t ld, int r0, int n, int T, int hs)
{
	for (int e = threadIdx.x; e < n * HS; e += blockDim.x) {
		int j = e / HS, i = e % HS;
		a[j * TC_LD + i] = r0 + j < T && i < hs
					   ? wmma::__float_to_tf32(x[(size_t)(r0 + j) * ld + i]) : 0.0f;
	}
}

/* the warp's 16 x HS rows of a staged (TC_ROWS, TC_LD) block as HS / 8 operands */
template <int HS> static __device__ void tc_rows(tc_a (&f)[HS / 8], const float *rows)
{
#pragma unroll
	for (int k = 0; k < HS / 8; k++)
		wmma::load_matrix_sync(f[k], rows + 8 * k, TC_LD);
}

/* the 16 rows 16 slab .. of x's rows r0 .. r0 + TC_ROWS - 1 (an hs-wide slice of a (T, ld)
 * matrix) as TF32 operands, through buf (TC_ROWS, TC_LD), into f of the warps that take them
 * (every warp of the block calls it: it stages with all and syncs) */
template <int HS>
static __device__ void tc_rows_of(tc_a (&f)[HS / 8], float *buf, const float *x, size_t ld,
				  int r0, int T, int hs, int slab, bool take)
{
	tc_stage<HS>(buf, x, ld, r0, TC_ROWS, T, hs);
	__syncthreads();
	if (take)
		tc_rows<HS>(f, buf + 16 * slab * TC_LD);
	__syncthreads(); /* buf is staged again next */
}

/* out (16, TC_TILE) scratch = x (16, HS: registers) @ y^T, y a staged (TC_TILE, TC_LD) tile */
template <int HS>
static __device__ void tc_times_tile_t(float *out, const tc_a (&x)[HS / 8], const float *y)
{
#pragma unroll
	for (int n = 0; n < TC_TILE / 16; n++) {
		tc_acc acc;
		wmma::fill_fragment(acc, 0.0f);
#pragma unroll
		for (int k = 0; k < HS / 8; k++) {
			tc_bt b;	/* y^T's (8, 16) block: y's rows 16 n.., columns 8 k.. */
			wmma::load_matrix_sync(b, y + 16 * n * TC_LD + 8 * k, TC_LD);
			wmma::mma_sync(acc, x[k], b, acc);
		}
		wmma::store_matrix_sync(out + 16 * n, acc, TC_SLD, wmma::mem_row_major);
	}
}

/* acc (16, HS) += p (16, TC_TILE) scratch @ y, y a staged (TC_TILE, TC_LD) tile */
template <int HS>
static __device__ void tc_tile_times(tc_acc (&acc)[HS / 16], const float *p, const float *y)
{
#pragma unroll
	for (int k = 0; k < TC_TILE / 8; k++) {
		tc_a a;
		wmma::load_matrix_sync(a, p + 8 * k, TC_SLD);
		tc_round(a);
#pragma unroll
		for (int n = 0; n < HS / 16; n++) {
			tc_b b;
			wmma::load_matrix_sync(b, y + 8 * k * TC_LD + 16 * n, TC_LD);
			wmma::mma_sync(acc[n], a, b, acc[n]);
		}
	}
}

/* the warp's accumulators (16, HS), through its rows of the staging block `rows`, into
 * dst's rows r0 .. r0 + 15 below T (row stride ld), its first hs columns */
template <int HS>
static __device__ void tc_write(float *dst, size_t ld, const tc_acc (&acc)[HS / 16], float *rows,
				int r0, int T, int hs)
{
	const int lane = threadIdx.x % 32;
#pragma unroll
	for (int n = 0; n < HS / 16; n++)
		wmma::store_matrix_sync(rows + 16 * n, acc[n], TC_LD, wmma::mem_row_major);
	__syncwarp();
	for (int e = lane; e < 16 * hs; e += 32) {
		int r = e / hs, i = e % hs;
		if (r0 + r < T)
			dst[(size_t)(r0 + r) * ld + i] = rows[r * TC_LD + i];
	}
	__syncwarp();
}

// out (B,T,C), lse (B,NH,T), qkv (B,T,3C); grid (B NH, T / TC_ROWS), block 32 TC_WARPS
template <int HS>
static __global__ void __launch_bounds__(32 * TC_WARPS)
	attention_flash_tc_forward_kernel(float *out, float *lse, const float *qkv, int T, int C,
					  int NH, float scale)
{
	__shared__ __align__(32) float kv[2 * TC_TILE * TC_LD];	    /* k tile, v tile */
	__shared__ __align__(32) float sc[TC_WARPS][16 * TC_SLD];   /* scores, then weights */
	__shared__ __align__(32) float os[TC_WARPS][16 * TC_LD];    /* the rows' output so far */
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	/* the last rows first: their blocks walk the most key tiles (the causal half), so the
	 * long ones start first and the short ones fill in after */
	const int t0 = (gridDim.y - 1 - blockIdx.y) * TC_ROWS, w0 = t0 + 16 * warp;
	const int last = flash_min(t0 + TC_ROWS, T) - 1, wlast = flash_min(w0 + 16, T) - 1;
	const int r = lane / 2, half = lane % 2, t = w0 + r;  /* two lanes a row, every other key each */
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	float *ks = kv, *vs = kv + TC_TILE * TC_LD, *s = sc[warp], *o = os[warp];

	tc_a q[HS / 8];
	tc_rows_of<HS>(q, kv, head, C3, t0, T, hs, warp, true);
	for (int e = lane; e < 16 * TC_LD; e += 32)
		o[e] = 0.0f;
	float m = -INFINITY, l = 0.0f;
	for (int j0 = 0; j0 <= last; j0 += TC_TILE) {
		tc_stage<HS>(ks, head + C, C3, j0, TC_TILE, T, hs);
		tc_stage<HS>(vs, head + 2 * C, C3, j0, TC_TILE, T, hs);
		__syncthreads();
		if (w0 < T && j0 <= wlast) {	/* the warp's rows see keys of this tile */
			tc_times_tile_t<HS>(s, q, ks);
			__syncwarp();
			/* the online softmax of row t over keys j0 + half, + 2, .. (those <= t): the
			 * row's two lanes interleaved, 2-way bank conflicts at most */
			float *sr = s + r * TC_SLD + half, mt = m;
#pragma unroll
			for (int c = 0; c < 32; c += 2) {
				const int j = j0 + c + half;
				sr[c] = j <= t && t < T ? sr[c] * scale : -INFINITY;
				mt = fmaxf(mt, sr[c]);
			}
			mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
			const bool any = mt != -INFINITY;   /* row t sees a key of the tile */
			const float corr = any && m != -INFINITY ? expf(m - mt) : any ? 0.0f : 1.0f;
			float sum = 0.0f;
#pragma unroll
			for (int c = 0; c < 32; c += 2) {
				sr[c] = any && sr[c] != -INFINITY ? expf(sr[c] - mt) : 0.0f;
				sum += sr[c];
			}
			sum += __shfl_xor_sync(0xffffffffu, sum, 1);
			if (any) {
				l = l * corr + sum;
				m = mt;
			}
			for (int i = half; i < HS; i += 2)
				o[r * TC_LD + i] *= corr;
			__syncwarp();
			tc_acc acc[HS / 16];	/* o += p v */
#pragma unroll
			for (int n = 0; n < HS / 16; n++)
				wmma::load_matrix_sync(acc[n], o + 16 * n, TC_LD, wmma::mem_row_major);
			tc_tile_times<HS>(acc, s, vs);
#pragma unroll
			for (int n = 0; n < HS / 16; n++)
				wmma::store_matrix_sync(o + 16 * n, acc[n], TC_LD, wmma::mem_row_major);
			__syncwarp();
		}
		__syncthreads(); /* the next tile overwrites ks, vs */
	}
	if (t < T) {
		float *y = out + ((size_t)b * T + t) * C + h * hs;
		for (int i = half; i < hs; i += 2)
			y[i] = o[r * TC_LD + i] / l;
		if (half == 0)
			lse[(size_t)bh * T + t] = m + logf(l);
	}
}

/* dq per query row over its key tiles (as attention_flash_dq_kernel): with g = scale a (da -
 * dsum), a = exp(scale q.k - lse), da = dy . v: dq = g k, the products on tensor cores */
template <int HS>
static __global__ void __launch_bounds__(32 * TC_WARPS)
	attention_flash_tc_dq_kernel(float *dqkv, const float *dsum, const float *dout,
				     const float *qkv, const float *lse, int T, int C, int NH,
				     float scale)
{
	__shared__ __align__(32) float kv[2 * TC_TILE * TC_LD];
	__shared__ __align__(32) float sc[TC_WARPS][16 * TC_SLD];   /* scores, then g */
	__shared__ __align__(32) float dp[TC_WARPS][16 * TC_SLD];   /* da */
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	const int t0 = (gridDim.y - 1 - blockIdx.y) * TC_ROWS, w0 = t0 + 16 * warp; /* as above */
	const int last = flash_min(t0 + TC_ROWS, T) - 1, wlast = flash_min(w0 + 16, T) - 1;
	const int r = lane / 2, half = lane % 2, t = w0 + r;
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	const float *dyh = dout + (size_t)b * T * C + h * hs;
	float *ks = kv, *vs = kv + TC_TILE * TC_LD, *s = sc[warp], *d = dp[warp];

	tc_a q[HS / 8], dy[HS / 8];
	tc_rows_of<HS>(q, kv, head, C3, t0, T, hs, warp, true);
	tc_rows_of<HS>(dy, kv, dyh, C, t0, T, hs, warp, true);
	const float lt = t < T ? lse[(size_t)bh * T + t] : 0.0f;
	const float dt = t < T ? dsum[(size_t)bh * T + t] : 0.0f;
	tc_acc dq[HS / 16];
#pragma unroll
	for (int n = 0; n < HS / 16; n++)
		wmma::fill_fragment(dq[n], 0.0f);
	for (int j0 = 0; j0 <= last; j0 += TC_TILE) {
		tc_stage<HS>(ks, head + C, C3, j0, TC_TILE, T, hs);
		tc_stage<HS>(vs, head + 2 * C, C3, j0, TC_TILE, T, hs);
		__syncthreads();
		if (w0 < T && j0 <= wlast) {
			tc_times_tile_t<HS>(s, q, ks);
			tc_times_tile_t<HS>(d, dy, vs);
			__syncwarp();
			float *sr = s + r * TC_SLD + half, *dr = d + r * TC_SLD + half;
#pragma unroll
			for (int c = 0; c < 32; c += 2) {	/* keys j0 + half, + 2, .. */
				const int j = j0 + c + half;
				sr[c] = j <= t && t < T ? scale * (expf(sr[c] * scale - lt) * (dr[c] - dt))
						      : 0.0f;
			}
			__syncwarp();
			tc_tile_times<HS>(dq, s, ks);
			__syncwarp(); /* the next tile's scores overwrite s */
		}
		__syncthreads();
	}
	tc_write<HS>(dqkv + (size_t)b * T * C3 + h * hs, C3, dq, kv + 16 * warp * TC_LD, w0, T, hs);
}

/* dk, dv per key row j over the query tiles from the block's first key on (as
 * attention_flash_dkv_kernel): dv = a dy_t, dk = g q_t summed over the queries t >= j.
 * Two warps a 16-row slab, 2 TC_WARPS a block: the slab's k warp holds its k and sums dv, its
 * v warp holds its v and sums dk (one warp holding both, with both sums, took 255 registers
 * at HS 64 and spilled: ptxas, docs/gpus.md); a tile's scores k.q and v.dy go to the slab's
 * scratch, where the two warps turn them into a and g (4 lanes a row), and each then adds its
 * product, the block's barriers between. */
#define TC_DKV_WARPS (2 * TC_WARPS)
template <int HS>
static __global__ void __launch_bounds__(32 * TC_DKV_WARPS)
	attention_flash_tc_dkv_kernel(float *dqkv, const float *dsum, const float *dout,
				      const float *qkv, const float *lse, int T, int C, int NH,
				      float scale)
{
	__shared__ __align__(32) float qd[2 * TC_TILE * TC_LD];	    /* q tile, dy tile */
	__shared__ __align__(32) float pt[TC_WARPS][16 * TC_SLD];   /* k.q scores, then a */
	__shared__ __align__(32) float gt[TC_WARPS][16 * TC_SLD];   /* v.dy, then g */
	__shared__ float ls[TC_TILE], ds[TC_TILE];
	const int bh = blockIdx.x, b = bh / NH, h = bh % NH, hs = C / NH, C3 = 3 * C;
	const int warp = threadIdx.x / 32, slab = warp % TC_WARPS;
	const bool kw = warp < TC_WARPS;	/* the slab's k warp (else its v warp) */
	const int j0 = blockIdx.y * TC_ROWS, w0 = j0 + 16 * slab;  /* the block's, slab's keys */
	const int pl = (kw ? 0 : 32) + threadIdx.x % 32;	/* the slab's lanes 0 .. 63 */
	const int r = pl / 4, quarter = pl % 4, j = w0 + r;	/* 4 lanes a row */
	const float *head = qkv + (size_t)b * T * C3 + h * hs;
	const float *dyh = dout + (size_t)b * T * C + h * hs;
	float *qs = qd, *dys = qd + TC_TILE * TC_LD, *p = pt[slab], *g = gt[slab];

	tc_a x[HS / 8];	/* the slab's k (k warp) or v (v warp) */
	tc_rows_of<HS>(x, qd, head + C, C3, j0, T, hs, slab, kw);
	tc_rows_of<HS>(x, qd, head + 2 * C, C3, j0, T, hs, slab, !kw);
	tc_acc acc[HS / 16];	/* dv (k warp) or dk (v warp) */
#pragma unroll
	for (int n = 0; n < HS / 16; n++)
		wmma::fill_fragment(acc[n], 0.0f);
	for (int t0 = j0; t0 < T; t0 += TC_TILE) {
		tc_stage<HS>(qs, head, C3, t0, TC_TILE, T, hs);
		tc_stage<HS>(dys, dyh, C, t0, TC_TILE, T, hs);
		for (int e = threadIdx.x; e < TC_TILE; e += blockDim.x) {
			ls[e] = t0 + e < T ? lse[(size_t)bh * T + t0 + e] : 0.0f;
			ds[e] = t0 + e < T ? dsum[(size_t)bh * T + t0 + e] : 0.0f;
		}
		__syncthreads();
		/* a query of the tile sees the slab's keys (both its warps alike) */
		const bool sees = w0 < T && t0 + TC_TILE > w0;
		if (sees)
			tc_times_tile_t<HS>(kw ? p : g, x, kw ? qs : dys);
		__syncthreads(); /* the slab's p and g both written */
		if (sees) {
			float *pr = p + r * TC_SLD + quarter, *gr = g + r * TC_SLD + quarter;
#pragma unroll
			for (int c = 0; c < TC_TILE; c += 4) {	/* queries t0 + quarter, + 4, .. */
				const int e = c + quarter, tq = t0 + e;
				const bool on = tq >= j && tq < T && j < T;
				const float a = on ? expf(pr[c] * scale - ls[e]) : 0.0f;
				gr[c] = on ? scale * (a * (gr[c] - ds[e])) : 0.0f;
				pr[c] = a;
			}
		}
		__syncthreads(); /* a and g of the slab's 16 rows both done */
		if (sees)
			tc_tile_times<HS>(acc, kw ? p : g, kw ? dys : qs);
		__syncthreads(); /* the next tile overwrites qs, dys, p, g */
	}
	/* the k warps' dv, then the v warps' dk, each through its slab's rows of qd */
	float *rows = qd + 16 * slab * TC_LD;
	float *dst = dqkv + (size_t)b * T * C3 + h * hs;
	if (kw)
		tc_write<HS>(dst + 2 * C, C3, acc, rows, w0, T, hs);
	__syncthreads();
	if (!kw)
		tc_write<HS>(dst + C, C3, acc, rows, w0, T, hs);
}

/* the tensor-core kernels' head size, HS = hs rounded up to 16 columns, or 0 where they
 * do not run (not TF32, or a head size not a multiple of 8) */
static int flash_tc_width(const struct sl_gpu *g, int hs)
{
	if (!g->tf32 || hs % 8 != 0 || hs > FLASH_HS)
		return 0;
	return (hs + 15) / 16 * 16;
}

template <int HS>
static void flash_tc_forward(const struct sl_gpu *g, float *out, float *lse, const float *qkv,
			     int B, int T, int C, int NH, float scale)
{
	dim3 grid((unsigned)(B * NH), (unsigned)((T + TC_ROWS - 1) / TC_ROWS));
	SL_LAUNCH(attention_flash_tc_forward_kernel<HS>, grid, 32 * TC_WARPS, 0, sl_stream(g),
		  out, lse, qkv, T, C, NH, scale);
}

template <int HS>
static void flash_tc_backward(const struct sl_gpu *g, float *dqkv, const float *dsum,
			      const float *dout, const float *qkv, const float *lse, int B,
			      int T, int C, int NH, float scale)
{
	dim3 grid((unsigned)(B * NH), (unsigned)((T + TC_ROWS - 1) / TC_ROWS));
	SL_LAUNCH(attention_flash_tc_dq_kernel<HS>, grid, 32 * TC_WARPS, 0, sl_stream(g), dqkv,
		  dsum, dout, qkv, lse, T, C, NH, scale);
	SL_LAUNCH(attention_flash_tc_dkv_kernel<HS>, grid, 32 * TC_DKV_WARPS, 0, sl_stream(g), dqkv,
		  dsum, dout, qkv, lse, T, C, NH, scale);
}

// out (B,T,C), lse (B,NH,T), qkv (B,T,3C) = [q | k | v] per token
void attention_flash_forward_cuda(const struct sl_gpu *g, float *out, float *lse,
				  const float *qkv, int B, int T, int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int hs = C / NH;
	const float scale = 1.0f / sqrtf((float)hs);
	flash_check(hs);
	switch (flash_tc_width(g, hs)) {
	case 16: flash_tc_forward<16>(g, out, lse, qkv, B, T, C, NH, scale); return;
	case 32: flash_tc_forward<32>(g, out, lse, qkv, B, T, C, NH, scale); return;
	case 48: flash_tc_forward<48>(g, out, lse, qkv, B, T, C, NH, scale); return;
	case 64: flash_tc_forward<64>(g, out, lse, qkv, B, T, C, NH, scale); return;
	}
	SL_LAUNCH(attention_flash_forward_kernel, flash_grid(B, T, NH), FLASH_ROWS, 0, sl_stream(g),
		  out, lse, qkv, T, C, NH, scale);
}

// dqkv (B,T,3C) =, dsum (B,NH,T) scratch, dout (B,T,C), qkv, out (B,T,C), lse (B,NH,T)
void attention_flash_backward_cuda(const struct sl_gpu *g, float *dqkv, float *dsum,
				   const float *dout, const float *qkv, const float *out,
				   const float *lse, int B, int T, int C, int NH)
{
	if (B <= 0 || T <= 0)
		return;
	const int hs = C / NH, rows = B * NH * T;
	const float scale = 1.0f / sqrtf((float)hs);
	flash_check(hs);
	SL_LAUNCH(attention_flash_dsum_kernel, softmax_blocks(rows), 32 * ROWS_PER_BLOCK, 0,
		  sl_stream(g), dsum, dout, out, rows, T, C, NH);
	switch (flash_tc_width(g, hs)) {
	case 16: flash_tc_backward<16>(g, dqkv, dsum, dout, qkv, lse, B, T, C, NH, scale); return;
	case 32: flash_tc_backward<32>(g, dqkv, dsum, dout, qkv, lse, B, T, C, NH, scale); return;
	case 48: flash_tc_backward<48>(g, dqkv, dsum, dout, qkv, lse, B, T, C, NH, scale); return;
	case 64: flash_tc_backward<64>(g, dqkv, dsum, dout, qkv, lse, B, T, C, NH, scale); return;
	}
	SL_LAUNCH(attention_flash_dq_kernel, flash_grid(B, T, NH), FLASH_ROWS, 0, sl_stream(g),
		  dqkv, dsum, dout, qkv, lse, T, C, NH, scale);
	SL_LAUNCH(attention_flash_dkv_kernel, flash_grid(B, T, NH), FLASH_DKV_THREADS, 0,
		  sl_stream(g), dqkv, dsum, dout, qkv, lse, T, C, NH, scale);
}
