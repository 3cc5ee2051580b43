/* Helpers for the kernels' OpenMP loops (a private header: cffi does not see it). */
#ifndef SL_KERNELS_PARALLEL_H
#define SL_KERNELS_PARALLEL_H
#include <omp.h>

/* The calling thread's share [*lo, *hi) of [0, n) in a parallel region, in whole runs of 16
 * floats (a cache line) so that threads do not share cache lines. Contiguous, in thread
 * order, and fixed by n and the team size. */
static inline void thread_runs16(int n, int *lo, int *hi)
{
	int nth = omp_get_num_threads(), tid = omp_get_thread_num();
	int nrun = (n + 15) / 16;
	*lo = (int)((long)nrun * tid / nth) * 16;
	*hi = (int)((long)nrun * (tid + 1) / nth) * 16;
	if (*lo > n)
		*lo = n;
	if (*hi > n)
		*hi = n;
}
#endif
