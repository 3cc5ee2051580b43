/* Stub for compiling against a CUDA StarPU without cuSPARSE (tools/cuda-stubs/README.md). */
#ifndef SL_STUB_CUSPARSE_H
#define SL_STUB_CUSPARSE_H
typedef struct cusparseContext *cusparseHandle_t;
#endif
