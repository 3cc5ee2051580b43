/* The gradient clipping factor, shared by the CPU kernels (gradnorm.c: clip_scale) and the GPU
 * ones (csrc/cuda/adamw.cu), so that both clip by the same formula. */
#ifndef SL_KERNELS_CLIP_H
#define SL_KERNELS_CLIP_H
#include <math.h>

#if defined(__CUDACC__) || defined(SL_CUDA_EMULATION)
#define SL_HOST_DEVICE __host__ __device__
#else
#define SL_HOST_DEVICE
#endif

/* min(1, max_norm / (||g|| + 1e-6)), ||g|| = sqrt(sumsq) (as torch.nn.utils.clip_grad_norm_) */
static inline SL_HOST_DEVICE float sl_clip_scale(double sumsq, float max_norm)
{
	double scale = (double)max_norm / (sqrt(sumsq) + 1e-6);
	return scale < 1.0 ? (float)scale : 1.0f;
}
#endif
