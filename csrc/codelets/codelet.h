/* What every codelet file shares: thread control for the cores a task owns, task tracing,
 * the gradient access mode and small accessors. One codelet file per layer includes it. */
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

/* Access mode of a parameter-gradient buffer: plain RW with one contributor at a time, or
 * STARPU_REDUX when several sub-batches add into it concurrently (data parallelism). */
static inline enum starpu_data_access_mode sl_grad_mode(int redux)
{
	return redux ? STARPU_REDUX : STARPU_RW;
}

/* Called first in every codelet: sizes this thread's OpenMP team and BLAS to the k cores of
 * the (possibly combined) worker running the task, binds team thread t to the t-th core,
 * and opens a trace record. Returns the trace slot to give to sl_task_end. */
long sl_task_begin(int codelet_id);
void sl_task_end(long slot);

/* Per-codelet tuning hook: sl_start sets every registered codelet to SEQ (k=1) or FORKJOIN
 * with max_parallelism k. Each codelet file registers its codelets with this. */
void sl_codelet_register(struct starpu_codelet *cl);
void sl_codelets_set_cores(int k);
/* With parallel workers the task's team size is set by StarPU's OpenMP prologue (the
 * parallel worker's cores): tasks then take k from omp_get_max_threads(). */
void sl_codelets_set_team_from_runtime(int on);
/* Team mode: worker w's tasks run a k-thread team bound to cores[w*k + t] (cores NULL:
 * core w*k + t); nworkers 0 turns team mode off. */
void sl_codelets_set_team_groups(int nworkers, int k, const int *cores);

/* Each codelet file lists its codelets once; they are registered when the library loads. */
#define SL_REGISTER_CODELETS(...)                                                   \
	static void __attribute__((constructor)) sl_register_file_codelets(void)    \
	{                                                                           \
		struct starpu_codelet *cls[] = { __VA_ARGS__ };                     \
		for (size_t i = 0; i < sizeof cls / sizeof cls[0]; i++)             \
			sl_codelet_register(cls[i]);                                \
	}

/* Allocate an args struct for STARPU_CL_ARGS_NFREE; freed by sl_args_free_completed(),
 * which the runtime calls once every submitted task has completed. */
void *sl_args_alloc(size_t size);
void sl_args_free_completed(void);

/* Every submit helper inserts its task through this one macro. sl_exec_worker pins the task
 * to one StarPU worker (-1: any worker, the scheduler decides); the runtime sets it while a
 * sub-batch is submitted, so each data-parallel worker keeps its own sub-batch. Under
 * StarPU-MPI every process submits every task: starpu_mpi_task_insert runs it where
 * sl_exec_node says (the rank owning the sub-batch, or the owner of the parameters for
 * updates) and posts the transfers its data needs. */
extern int sl_exec_worker;
#ifdef SL_HAVE_MPI
#include <starpu_mpi.h>
extern int sl_mpi_active;
extern MPI_Comm sl_mpi_comm;
extern int sl_exec_node;
#define SL_INSERT(cl, ...)                                                                \
	(sl_mpi_active ? starpu_mpi_task_insert(sl_mpi_comm, cl, STARPU_EXECUTE_ON_NODE,   \
						sl_exec_node, STARPU_EXECUTE_ON_WORKER,     \
						sl_exec_worker, __VA_ARGS__)                \
		       : starpu_task_insert(cl, STARPU_EXECUTE_ON_WORKER, sl_exec_worker,  \
					    __VA_ARGS__))
#else
#define SL_INSERT(cl, ...) \
	starpu_task_insert(cl, STARPU_EXECUTE_ON_WORKER, sl_exec_worker, __VA_ARGS__)
#endif

/* Return code check for submissions: turns -ENODEV etc. into a printed, returned error. */
int sl_check_submit(int ret, const char *what);

#define SL_CODELET_IDS(X) \
	X(ENCODER_FWD, "encoder_forward") X(ENCODER_BWD, "encoder_backward") \
	X(LAYERNORM_FWD, "layernorm_forward") X(LAYERNORM_BWD, "layernorm_backward") \
	X(MATMUL_FWD, "matmul_forward") X(MATMUL_BWD, "matmul_backward") \
	X(ATTENTION_FWD, "attention_forward") X(ATTENTION_BWD, "attention_backward") \
	X(GELU_FWD, "gelu_forward") X(GELU_BWD, "gelu_backward") \
	X(RESIDUAL_FWD, "residual_forward") X(RESIDUAL_BWD, "residual_backward") \
	X(XENT_FWD, "crossentropy_forward") X(XENT_BWD, "crossentropy_backward") \
	X(ADAMW, "adamw") X(LOAD, "load_batch") X(ZERO, "zero") X(ADD, "add") X(PROBE, "probe")

#define SL_ID_ENUM(id, name) SL_CL_##id,
enum { SL_CODELET_IDS(SL_ID_ENUM) SL_CL_COUNT };
#undef SL_ID_ENUM

#endif
