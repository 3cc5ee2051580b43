/* What the files of the StarPU layer share, and Python must not see (the cffi module is
 * generated from sl_api.h, sl_codelets.h and kernels.h only). The calls go one way:
 *   runtime.c -> submit.c -> codelets.c -> threads.c, trace.c -> the codelet table
 *   runtime.c, submit.c -> mpi.c
 *   runtime.c -> ooc.c
 * (a file calls only files to its right or below; none calls back up). */
#ifndef SL_INTERNAL_H
#define SL_INTERNAL_H
#include <starpu.h>
#include <stdint.h>
#include "compat.h"
#include "sl_api.h"
#include "../codelets/codelet.h"

/* ---- mpi.c ---- */
int sl_mpi_start(struct starpu_conf *conf, const void *comm);
/* 1 when MPI was not used (the caller shuts StarPU down); else StarPU-MPI and StarPU shut
 * down (starpu_mpi_shutdown does both), and 0, or its error (< 0). */
int sl_mpi_stop(void);
/* The communicator StarPU-MPI runs on, or NULL when it does not run. */
const void *sl_mpi_comm(void);

/* ---- ooc.c: the memory limit and the disk node (sl_set_memory_limit) ---- */
/* Before starpu_init: sets (or clears) STARPU_LIMIT_CPU_MEM. */
int sl_ooc_before_init(void);
/* After starpu_init: registers the disk node when there is a limit. */
int sl_ooc_after_init(void);
void sl_ooc_after_shutdown(void);
int sl_ooc_enabled(void);

/* ---- submit.c ---- */
/* Frees the task arguments; call once every submitted task has completed. */
void sl_args_free_completed(void);

/* ---- codelets.c: a StarPU codelet for every codelet of the table ---- */
/* Builds them (once) and sets every one but the sequential ones to run on cores_per_worker
 * cores (FORKJOIN for more than one, else SEQ); with ncuda > 0 (a CUDA build), those with a
 * CUDA body get their CUDA function. */
void sl_codelets_setup(int cores_per_worker, int ncuda);
struct starpu_codelet *sl_starpu_codelet(int codelet);
#ifdef SL_HAVE_CUDA
/* Every CUDA worker's scratch (cuda_kernels.h), made on its thread (start 1) or freed (0). */
void sl_codelets_cuda_workers(int start);
#endif
/* The StarPU access mode of SL_ACCESS_* bits. */
enum starpu_data_access_mode sl_starpu_mode(int32_t access);

/* ---- threads.c ---- */
/* The cores of the worker running the task: sizes this thread's OpenMP team and BLAS, binds
 * the team; returns the team size. */
int sl_task_threads(void);
/* The partition as started (sl_start; SL_KCORE_SINGLE, 0, 1, NULL when stopped), once:
 * kcore SL_KCORE_TEAM: CPU worker w's tasks (the w-th CPU worker: GPU workers come first in
 * StarPU's numbering) run a cores_per_worker-thread team bound to
 * cores[w * cores_per_worker + t] (cores NULL: core w * cores_per_worker + t);
 * every task reads cores_per_worker (K; SL_KCORE_PARALLEL: the team StarPU's OpenMP prologue
 * sized, of the parallel worker's K cores), but a FORKJOIN codelet run sequentially on a
 * basic worker: 1. */
void sl_codelets_set_partition(int kcore, int nworkers, int cores_per_worker, const int *cores);

/* ---- trace.c ---- */
/* Opens the record of a task of codelet running on ncores; returns its slot (-1: none). */
long sl_trace_begin(int codelet, int ncores);
void sl_trace_end(long slot);
/* A CUDA task's GPU time in the trace: an event on its stream before (end 0) and after (end
 * 1) its body queues its kernels (trace.c; the CUDA build only). */
void sl_trace_gpu_mark(long slot, void *stream, int end);

#endif
