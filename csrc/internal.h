/* What runtime.c, mpi.c and the codelet machinery share, and Python must not see (the cffi
 * module is generated from sl_api.h and kernels.h only). */
#ifndef SL_INTERNAL_H
#define SL_INTERNAL_H
#include <starpu.h>
#include <stdint.h>
#include "codelets/compat.h"
#include "sl_api.h"

/* ---- runtime.c ---- */
/* Where a task runs: the StarPU-MPI rank (ignored without MPI) and the StarPU worker (-1: the
 * scheduler decides). The runtime holds the placement of the tasks submitted next, set by
 * sl_mpi_set_exec_node / sl_set_exec_worker, so that each data-parallel sub-batch keeps its
 * worker and rank. */
struct sl_placement {
	int node;
	int worker;
};
struct sl_placement sl_task_placement(void);

/* ---- mpi.c ---- */
int sl_mpi_start(struct starpu_conf *conf, const void *comm);
/* Returns 0 when it shut StarPU down (starpu_mpi_shutdown does), 1 when MPI was not used. */
int sl_mpi_stop(void);
/* Inserts a task of cl on these buffers at `where`. Under StarPU-MPI every process submits
 * every task: starpu_mpi_task_insert runs it on where.node and posts the transfers its data
 * needs. args (STARPU_CL_ARGS_NFREE) stay the caller's; flops goes to StarPU's statistics. */
int sl_insert_task(struct sl_placement where, struct starpu_codelet *cl,
		   struct starpu_data_descr *buffers, int nbuffers, void *args, size_t args_size,
		   double flops);

/* ---- codelets/registry.c ---- */
/* Every registered codelet runs on k cores (FORKJOIN for k > 1, else SEQ). */
void sl_codelets_set_cores(int k);
/* Frees the task arguments; call once every submitted task has completed. */
void sl_args_free_completed(void);

/* ---- codelets/threads.c ---- */
/* With parallel workers the task's team size is set by StarPU's OpenMP prologue (the
 * parallel worker's cores): tasks then take k from omp_get_max_threads(). */
void sl_codelets_set_team_from_runtime(int on);
/* Team mode: worker w's tasks run a k-thread team bound to cores[w*k + t] (cores NULL:
 * core w*k + t); nworkers 0 turns team mode off. */
void sl_codelets_set_team_groups(int nworkers, int k, const int *cores);

/* ---- codelets/trace.c ---- */
/* A StarPU access mode as SL_ACCESS_* bits (the trace's and sl_codelet_modes' encoding). */
int32_t sl_access_bits(enum starpu_data_access_mode m);

#endif
