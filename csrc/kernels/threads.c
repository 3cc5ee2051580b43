/* The threads a kernel call may use: the calling thread's OpenMP team size and its BLAS
 * threads, set together (the reference loop sets them once; a codelet before each task). */
#include "kernels.h"
#include <omp.h>
#include <stdio.h>
#include "blas.h"

/* MKL has a thread-local setting; OpenBLAS's OpenMP build follows the caller's OpenMP team
 * size (omp_set_num_threads); its pthread build only has a process-global count, which is
 * right as long as every task of a run uses the same number of cores (an n x k partition). */
#if defined(SL_MKL_RT)
/* MKL's single dynamic library picks its threading layer at the first call (MKL_THREADING_LAYER,
 * else Intel's OpenMP): GNU's, at load, whatever the environment says (meson.build: why). */
__attribute__((constructor)) static void mkl_gnu_threads(void)
{
	mkl_set_threading_layer(MKL_THREADING_GNU);
}
#endif

void blas_set_threads(int k)
{
#if defined(SL_USE_MKL)
	mkl_set_num_threads_local(k);
#elif defined(SL_USE_OPENBLAS)
	if (openblas_get_parallel() == 1) /* 1 = pthread build, 2 = OpenMP build, 0 = serial */
		openblas_set_num_threads(k);
#else
	(void)k;
#endif
}

void kernels_set_threads(int k)
{
	omp_set_num_threads(k);
	blas_set_threads(k);
}

int kernels_threads(void) { return omp_get_max_threads(); }

const char *blas_name(void)
{
#if defined(SL_USE_MKL)
	return "mkl";
#elif defined(SL_USE_OPENBLAS)
	/* with the kernel family OpenBLAS chose for this CPU (or OPENBLAS_CORETYPE) */
	static char name[64];
	const char *build = openblas_get_parallel() == 0   ? "serial"
			    : openblas_get_parallel() == 1 ? "pthread"
							   : "openmp";
	snprintf(name, sizeof name, "openblas-%s (%s)", build, openblas_get_corename());
	return name;
#else
	return "cblas";
#endif
}
