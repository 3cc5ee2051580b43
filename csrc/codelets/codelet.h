/* What every codelet file shares: SL_CODELET, the one declaration of a codelet. StarPU-free:
 * the declarations are linked into both binding modules (the reference engine runs their
 * bodies directly; csrc/starpu/codelets.c makes StarPU codelets of them). */
#ifndef SL_CODELET_H
#define SL_CODELET_H
#include <stddef.h>
#include <stdint.h>
#include "../kernels/kernels.h"
#include "../cuda/cuda_kernels.h"
#include "sl_codelets.h"

/* A buffer as the body sees it: its memory (NULL: an optional buffer left out, or a buffer of
 * mode SL_ANY), its element count and element size. */
struct sl_buf {
	void *ptr;
	size_t n;
	size_t elemsize;
};

/* The declared mode of one buffer: fixed (R, W, RW), or chosen per task: */
enum sl_mode {
	SL_R,
	SL_W,
	SL_RW,
	SL_GRAD, /* a parameter gradient: RW with one contributor at a time, or STARPU_REDUX
		  * when several sub-batches add into it concurrently (data parallelism) */
	SL_ACC,	 /* W, or RW when the task adds into what is there: the int field of the
		  * arguments that SL_CODELET_ACC names says which */
	/* flags */
	SL_OPT = 16,	/* a trailing buffer a task may leave out (several: the last ones) */
	SL_REPEAT = 32, /* the buffer comes k >= 1 times in its place (k the same for every
			 * SL_REPEAT buffer of a task: the int field of the arguments that
			 * SL_CODELET_REPEAT names), e.g. a matrix in k row blocks */
	SL_ANY = 64,	/* any data interface, not only a vector: the body gets no pointer */
};
#define SL_MODE_KIND_MASK 15 /* the bits of a mode that give its kind (the flags: the bits above) */
#define SL_MODE_KIND(m) ((m) & SL_MODE_KIND_MASK)
#define SL_UNUSED __attribute__((unused))

/* Codelet flags */
#define SL_SEQUENTIAL 1	   /* always on one core (too small to share; reduction methods) */
#define SL_NO_PERFMODEL 2 /* no StarPU history perf model (diagnostics) */

struct sl_codelet {
	const char *name;
	const char *args_type;
	size_t args_size;
	int flags;
	int nbuffers; /* declared */
	int modes[SL_MAX_BUFFERS];
	ptrdiff_t accumulate_at; /* offset in args of the int selecting an SL_ACC buffer's mode; -1 */
	ptrdiff_t repeat_at;	 /* offset in args of the int counting the SL_REPEAT buffers; -1 */
	const char *repeat_field; /* that field's name ("" without) */
	/* the body on plain buffers, and the flop count (StarPU's statistics, the perf model) */
	void (*run)(const struct sl_buf *b, int n, const void *args);
	double (*flops)(const struct sl_buf *b, int n, const void *args);
	/* the CPU function StarPU calls for a task of this codelet (see sl_codelet_cpu) */
	void (*cpu)(void *buffers[], void *cl_arg);
	/* the body on device buffers, queued on g's stream (SL_CUDA; NULL: none, the tasks of
	 * this codelet run on CPUs), and the CUDA function StarPU calls (see sl_codelet_cuda) */
	void (*cuda_run)(const struct sl_buf *b, int n, const void *args, const struct sl_gpu *g);
	void (*cuda)(void *buffers[], void *cl_arg);
	int id; /* set at registration: the index in the table */
};

/* The table (table.c): filled at library load, in link order. */
#define SL_MAX_CODELETS 64
void sl_codelet_register(struct sl_codelet *c);
const struct sl_codelet *sl_codelet_get(int codelet);
/* The buffer's mode as SL_ACCESS_* bits for a task with this redux / accumulate. */
int32_t sl_mode_access(int mode, int redux, int accumulate);
/* The accumulate of a task of c with these arguments (0 for a codelet without SL_ACC). */
int sl_codelet_accumulate(const struct sl_codelet *c, const void *args);
/* The repeat count k of a task of c with these arguments (1 for a codelet without SL_REPEAT). */
int sl_codelet_repeats(const struct sl_codelet *c, const void *args);
/* The declared buffer that buffer i of a task with repeat count k is (each SL_REPEAT buffer
 * taking k places); -1 past the declaration. */
int sl_codelet_declared(const struct sl_codelet *c, int k, int i);
/* 0 when n buffers fit the declaration with repeat count k (k >= 1; every buffer but trailing
 * optional ones given), else -EINVAL. */
int sl_codelet_check_count(const struct sl_codelet *c, int n, int k);
/* What StarPU's CPU function of every codelet calls: set by the StarPU layer
 * (csrc/starpu/codelets.c) before the first task; NULL in the reference binding. */
extern void (*sl_codelet_cpu)(const struct sl_codelet *c, void *buffers[], void *cl_arg);
/* What StarPU's CUDA function of every codelet with a CUDA body calls: set by the StarPU layer
 * of a CUDA build; NULL otherwise. */
extern void (*sl_codelet_cuda)(const struct sl_codelet *c, void *buffers[], void *cl_arg);

/* Buffer i of the body's b as float / int32 / double pointer, and its element count. */
#define SL_F(i) ((float *)b[i].ptr)
#define SL_I(i) ((int32_t *)b[i].ptr)
#define SL_D(i) ((double *)b[i].ptr)
#define SL_N(i) (b[i].n)

/* The k row blocks of a matrix of C columns, buffers first .. first + k - 1 of the body's b:
 * their memory and row counts, for the kernels' *_blocks (kernels.h, Row blocks). */
static inline void sl_row_blocks(const struct sl_buf *b, int first, int k, int C, float **ptr,
				 int *rows)
{
	for (int i = 0; i < k; i++) {
		ptr[i] = (float *)b[first + i].ptr;
		rows[i] = (int)(b[first + i].n / (size_t)C);
	}
}

/* Declares codelet `cname`, registered at library load, in one place:
 *   args_t   its scalar arguments (a struct of sl_codelets.h), seen by the body as `a`;
 *   flags    SL_SEQUENTIAL, SL_NO_PERFMODEL or 0;
 *   flops    an expression of a, b (the buffers) and n (their count): the task's flop count;
 *   ...      the declared mode of each buffer (enum sl_mode), in order.
 * The body follows the macro as a block; it sees b (struct sl_buf[n]), n and a. */
#define SL_CODELET(cname, args_t, cflags, flops_expr, ...)                                         \
	SL_CODELET_DECLARE(cname, args_t, -1, -1, "", cflags, flops_expr, __VA_ARGS__)

/* The same for a codelet with an SL_ACC buffer (and only for one): acc_field, an int field of
 * args_t, is the task's accumulate (nonzero: the buffer is RW, else W). */
#define SL_CODELET_ACC(cname, args_t, acc_field, cflags, flops_expr, ...)                          \
	_Static_assert(sizeof(((args_t *)0)->acc_field) == sizeof(int),                            \
		       #args_t "." #acc_field " must be an int");                                  \
	SL_CODELET_DECLARE(cname, args_t, (ptrdiff_t)offsetof(args_t, acc_field), -1, "", cflags,  \
			   flops_expr, __VA_ARGS__)

/* The same for a codelet with SL_REPEAT buffers: count_field, an int field of args_t, is the
 * task's repeat count k (each SL_REPEAT buffer comes k times in its place; Python fills it
 * from the lists a call gives for those buffers). The body finds buffer j's i-th repeat
 * at index j + i when no repeated buffer precedes it (j + (k - 1) r + i after r of them). */
#define SL_CODELET_REPEAT(cname, args_t, count_field, cflags, flops_expr, ...)                     \
	_Static_assert(sizeof(((args_t *)0)->count_field) == sizeof(int),                          \
		       #args_t "." #count_field " must be an int");                                \
	SL_CODELET_DECLARE(cname, args_t, -1, (ptrdiff_t)offsetof(args_t, count_field),            \
			   #count_field, cflags, flops_expr, __VA_ARGS__)

#define SL_CODELET_DECLARE(cname, args_t, acc_at, rep_at, rep_field, cflags, flops_expr, ...)      \
	typedef args_t cname##_args_t;                                                             \
	static void cname##_body(const struct sl_buf *b SL_UNUSED, int n SL_UNUSED,                \
				 const args_t *a SL_UNUSED);                                       \
	static void cname##_run(const struct sl_buf *b, int n, const void *args)                   \
	{                                                                                          \
		cname##_body(b, n, (const args_t *)args);                                          \
	}                                                                                          \
	static double cname##_flops(const struct sl_buf *b, int n, const void *args)               \
	{                                                                                          \
		const args_t *a = args;                                                            \
		(void)a;                                                                           \
		(void)b;                                                                           \
		(void)n;                                                                           \
		return (flops_expr);                                                               \
	}                                                                                          \
	static struct sl_codelet cname##_codelet;                                                  \
	static void cname##_cpu(void *buffers[], void *cl_arg)                                     \
	{                                                                                          \
		sl_codelet_cpu(&cname##_codelet, buffers, cl_arg);                                 \
	}                                                                                          \
	static struct sl_codelet cname##_codelet = {                                               \
		.name = #cname,                                                                    \
		.args_type = #args_t,                                                              \
		.args_size = sizeof(args_t),                                                       \
		.flags = (cflags),                                                                 \
		.nbuffers = sizeof((const int[]){ __VA_ARGS__ }) / sizeof(int),                    \
		.modes = { __VA_ARGS__ },                                                          \
		.accumulate_at = (acc_at),                                                         \
		.repeat_at = (rep_at),                                                             \
		.repeat_field = (rep_field),                                                       \
		.run = cname##_run,                                                                \
		.flops = cname##_flops,                                                            \
		.cpu = cname##_cpu,                                                                \
		.cuda_run = NULL,                                                                  \
		.cuda = NULL,                                                                      \
	};                                                                                         \
	static void __attribute__((constructor)) cname##_register(void)                            \
	{                                                                                          \
		sl_codelet_register(&cname##_codelet);                                             \
	}                                                                                          \
	static void cname##_body(const struct sl_buf *b SL_UNUSED, int n SL_UNUSED,                \
				 const args_t *a SL_UNUSED)

/* The CUDA body of codelet `cname` (declared above it with SL_CODELET*), beside its CPU body:
 * the same buffers b, n and arguments a, the buffers in GPU memory; it queues its kernels on
 * the stream of g (struct sl_gpu, cuda_kernels.h) and returns without waiting. The body
 * follows the macro as a block. A codelet without one runs on CPUs only. */
#define SL_CUDA(cname)                                                                             \
	static void cname##_cuda_body(const struct sl_buf *b SL_UNUSED, int n SL_UNUSED,           \
				      const cname##_args_t *a SL_UNUSED,                           \
				      const struct sl_gpu *g);                                     \
	static void cname##_cuda_run(const struct sl_buf *b, int n, const void *args,              \
				     const struct sl_gpu *g)                                       \
	{                                                                                          \
		cname##_cuda_body(b, n, (const cname##_args_t *)args, g);                          \
	}                                                                                          \
	static void cname##_cuda_entry(void *buffers[], void *cl_arg)                                  \
	{                                                                                          \
		sl_codelet_cuda(&cname##_codelet, buffers, cl_arg);                                \
	}                                                                                          \
	static void __attribute__((constructor)) cname##_cuda_register(void)                       \
	{                                                                                          \
		cname##_codelet.cuda_run = cname##_cuda_run;                                       \
		cname##_codelet.cuda = cname##_cuda_entry;                                          \
	}                                                                                          \
	static void cname##_cuda_body(const struct sl_buf *b SL_UNUSED, int n SL_UNUSED,           \
				      const cname##_args_t *a SL_UNUSED, const struct sl_gpu *g)

#endif
