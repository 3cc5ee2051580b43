/* The one place that chooses the CBLAS header: MKL when built with -Dblas=mkl, else OpenBLAS. */
#ifndef SL_BLAS_H
#define SL_BLAS_H
#if defined(SL_USE_MKL)
#include <mkl.h>
#else
#include <cblas.h>
#endif
#endif
