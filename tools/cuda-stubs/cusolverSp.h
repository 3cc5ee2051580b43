/* Stub for compiling against a CUDA StarPU without cuSOLVER (tools/cuda-stubs/README.md). */
#ifndef SL_STUB_CUSOLVERSP_H
#define SL_STUB_CUSOLVERSP_H
typedef struct cusolverSpContext *cusolverSpHandle_t;
#endif
