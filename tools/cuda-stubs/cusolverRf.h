/* Stub for compiling against a CUDA StarPU without cuSOLVER (tools/cuda-stubs/README.md). */
#ifndef SL_STUB_CUSOLVERRF_H
#define SL_STUB_CUSOLVERRF_H
typedef struct cusolverRfCommon *cusolverRfHandle_t;
#endif
