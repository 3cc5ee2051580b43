/* What every codelet file shares: the codelet declaration (SL_CODELET: perf model, access
 * modes, codelet), the CPU function wrapper (SL_CPU_FUNC: cores and trace) and the submission
 * (SL_SUBMIT). One codelet file per layer includes it. */
#ifndef SL_CODELET_H
#define SL_CODELET_H
#include <starpu.h>
#include <stdint.h>
#include <stdlib.h>
#include "compat.h"
#include "../kernels/kernels.h"
#include "../sl_api.h"

/* Buffer i of a task as a float / int32 pointer (every handle here is a vector). */
#define SL_F(buffers, i) ((float *)STARPU_VECTOR_GET_PTR((buffers)[i]))
#define SL_I(buffers, i) ((int32_t *)STARPU_VECTOR_GET_PTR((buffers)[i]))

/* Every codelet, by the name of its codelet (and perf model, "sl_" name): SL_CL_<name>. */
#define SL_CODELET_NAMES(X)                                                                        \
	X(encoder_forward)                                                                         \
	X(encoder_backward)                                                                        \
	X(layernorm_forward)                                                                       \
	X(layernorm_backward)                                                                      \
	X(matmul_forward)                                                                          \
	X(matmul_backward)                                                                         \
	X(attention_forward)                                                                       \
	X(attention_backward)                                                                      \
	X(kv_append)                                                                               \
	X(attention_decode)                                                                        \
	X(gelu_forward)                                                                            \
	X(gelu_backward)                                                                           \
	X(residual_forward)                                                                        \
	X(crossentropy_forward)                                                                    \
	X(crossentropy_backward)                                                                   \
	X(adamw)                                                                                   \
	X(grad_sumsq)                                                                              \
	X(norm_sum)                                                                                \
	X(load_batch)                                                                              \
	X(zero)                                                                                    \
	X(add)                                                                                     \
	X(probe)

#define SL_ID_ENUM(name) SL_CL_##name,
enum { SL_CODELET_NAMES(SL_ID_ENUM) SL_CL_COUNT };
#undef SL_ID_ENUM

/* The declared access mode of one buffer of a codelet. Fixed (R, W, RW), or chosen per task: */
enum sl_mode {
	SL_R,
	SL_W,
	SL_RW,
	SL_GRAD,     /* a parameter gradient: RW with one contributor at a time, or STARPU_REDUX
		      * when several sub-batches add into it concurrently (data parallelism) */
	SL_ACC,	     /* W, or RW when the task adds into what is there (accumulate) */
	SL_OPT = 16, /* flag: a trailing buffer a task may leave out (NULL handle: matmul's bias) */
	/* (several trailing SL_OPT buffers: a task leaves out the last ones it does not have) */
};
#define SL_MAX_BUFFERS SL_TRACE_MAXBUF

/* A codelet with its declared modes: the one table the submission builds its tasks from, and
 * which Python reads back (sl_codelet_modes). */
struct sl_codelet {
	struct starpu_codelet cl;
	int id;		/* SL_CL_<name> */
	int sequential; /* always on one core (StarPU runs reduction methods on any worker) */
	int nbuffers;
	int modes[SL_MAX_BUFFERS]; /* enum sl_mode */
};

/* Registers c (table of codelets by id, cores per task); the codelet's nbuffers and modes are
 * set from the declared modes: fixed when they all are, else given with each task. */
void sl_codelet_register(struct sl_codelet *c);
/* The StarPU access mode of a declared mode for a task with this redux / accumulate. */
enum starpu_data_access_mode sl_mode_resolve(int mode, int redux, int accumulate);

/* Declares codelet `cname` (an SL_CODELET_NAMES entry) in one place: its codelet struct
 * cname##_codelet running cname##_cpu (see SL_CPU_FUNC), perf model `perfmodel`, and the
 * declared mode of each buffer (the variadic arguments, enum sl_mode), registered at library
 * load. */
#define SL_CODELET_DEF(cname, perfmodel, seq, ...)                                                 \
	static void cname##_cpu(void *buffers[], void *cl_arg);                                    \
	static struct sl_codelet cname##_codelet = {                                               \
		.cl = { .cpu_funcs = { cname##_cpu },                                              \
			.cpu_funcs_name = { #cname "_cpu" },                                       \
			.model = (perfmodel),                                                      \
			.name = #cname },                                                          \
		.id = SL_CL_##cname,                                                               \
		.sequential = (seq),                                                               \
		.nbuffers = sizeof((const int[]){ __VA_ARGS__ }) / sizeof(int),                    \
		.modes = { __VA_ARGS__ },                                                          \
	};                                                                                         \
	static void __attribute__((constructor)) cname##_register(void)                            \
	{                                                                                          \
		sl_codelet_register(&cname##_codelet);                                             \
	}

#define SL_PERFMODEL(cname)                                                                        \
	static struct starpu_perfmodel cname##_model = { .type = STARPU_HISTORY_BASED,             \
							 .symbol = "sl_" #cname };
/* A codelet on the task's k cores, with a history-based perf model "sl_<name>". */
#define SL_CODELET(cname, ...)                                                                     \
	SL_PERFMODEL(cname)                                                                        \
	SL_CODELET_DEF(cname, &cname##_model, 0, __VA_ARGS__)
/* A codelet always run on one core (a task too small to share), with its perf model. */
#define SL_SEQ_CODELET(cname, ...)                                                                 \
	SL_PERFMODEL(cname)                                                                        \
	SL_CODELET_DEF(cname, &cname##_model, 1, __VA_ARGS__)
/* A reduction method (init or reduce of a gradient): sequential. */
#define SL_REDUCTION_CODELET(cname, ...) SL_SEQ_CODELET(cname, __VA_ARGS__)

/* The CPU function of codelet `name`: sizes this thread's OpenMP team and BLAS to the cores
 * of the worker running the task, binds the team, and records the task in the trace around
 * the body that follows the macro, which sees `buffers` and `a` (the task's args_type); in a
 * dry run (sl_set_dry_run) the body is skipped. */
int sl_task_threads(void);
long sl_trace_begin(int codelet, int ncores);
void sl_trace_end(long slot);
#define SL_CPU_FUNC(name, args_type)                                                               \
	static void name##_body(void *buffers[], const args_type *a);                              \
	static void name##_cpu(void *buffers[], void *cl_arg)                                      \
	{                                                                                          \
		long slot = sl_trace_begin(SL_CL_##name, sl_task_threads());                       \
		if (!sl_dry_run())                                                                 \
			name##_body(buffers, cl_arg);                                              \
		sl_trace_end(slot);                                                                \
	}                                                                                          \
	static void name##_body(void *buffers[], const args_type *a)

/* Submits a task of c on the given handles (in declared order; a NULL last handle leaves an
 * optional buffer out), with the modes of c's table for this redux / accumulate, a copy of
 * args (args_size bytes, kept until sl_args_free_completed) and the task's flop count, where
 * the runtime places tasks now. Returns 0 or the negative error, printed. */
int sl_submit(struct sl_codelet *c, const sl_handle *handles, int nhandles, int redux,
	      int accumulate, const void *args, size_t args_size, double flops);
#define SL_HANDLES(...)                                                                            \
	(const sl_handle[]){ __VA_ARGS__ },                                                        \
		(int)(sizeof((const sl_handle[]){ __VA_ARGS__ }) / sizeof(sl_handle))
/* The common case: fixed modes, no flop count. */
#define SL_SUBMIT(name, args, ...)                                                                 \
	sl_submit(&name##_codelet, SL_HANDLES(__VA_ARGS__), 0, 0, &(args), sizeof(args), 0.0)
/* With per-task modes (redux, accumulate) and the task's flop count. */
#define SL_SUBMIT_EX(name, args, redux, accumulate, flops, ...)                                    \
	sl_submit(&name##_codelet, SL_HANDLES(__VA_ARGS__), (redux), (accumulate), &(args),        \
		  sizeof(args), (flops))

#endif
