/* Stub for compiling against a CUDA StarPU without cuSOLVER (tools/cuda-stubs/README.md). */
#ifndef SL_STUB_CUSOLVERDN_H
#define SL_STUB_CUSOLVERDN_H
typedef int cusolverStatus_t;
typedef struct cusolverDnContext *cusolverDnHandle_t;
#endif
