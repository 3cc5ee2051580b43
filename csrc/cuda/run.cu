/* The matmul precision of the GPU kernels, and each codelet's CUDA body run at once, outside
 * StarPU, on copies of host buffers: the CUDA twin of sl_codelet_run (csrc/codelets/table.c),
 * which the tests and the reference engine's GPU mode call (the body then runs on this
 * process's GPU 0, or in the CPU emulation of the CPU build). */
#include "gpu.h"
#include <errno.h>
#include <mutex>
#include <string.h>
extern "C" {
#include "../codelets/codelet.h"
}

static int matmul_tf32 = 1;

void sl_gpu_set_tf32(int tf32) { matmul_tf32 = tf32 != 0; }

int sl_gpu_tf32(void) { return matmul_tf32; }

extern "C" int sl_gpu_emulated(void)
{
#ifdef SL_CUDA_EMULATION
	return 1;
#else
	return 0;
#endif
}

extern "C" int sl_gpu_emulated_launches(unsigned *blocks, int max)
{
#ifdef SL_CUDA_EMULATION
	return sl_emu::take_launches(blocks, max);
#else
	(void)blocks;
	(void)max;
	return -ENOSYS;
#endif
}

extern "C" int sl_gpu_emulated_blas_calls(void)
{
#ifdef SL_CUDA_EMULATION
	return sl_emu::take_blas_calls();
#else
	return -ENOSYS;
#endif
}

extern "C" int sl_gpu_devices(void)
{
	int n = 0;
	cudaError_t err = cudaGetDeviceCount(&n);
	if (err == cudaSuccess)
		return n;
	(void)cudaGetLastError(); /* not left for the next call's check */
	return err == cudaErrorNoDevice ? 0 : -(int)err;
}

extern "C" int sl_gpu_runtime_version(void)
{
#ifdef SL_CUDA_EMULATION
	return 0;
#else
	return CUDART_VERSION;
#endif
}

extern "C" int sl_gpu_driver_version(void)
{
#ifdef SL_CUDA_EMULATION
	return 0;
#else
	int v = 0;
	if (cudaDriverGetVersion(&v) != cudaSuccess) {
		(void)cudaGetLastError();
		return 0;
	}
	return v;
#endif
}

extern "C" int sl_gpu_device_cc(int dev)
{
#ifdef SL_CUDA_EMULATION
	(void)dev;
	return -ENODEV;
#else
	int major = 0, minor = 0;
	cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
	if (err == cudaSuccess)
		err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
	if (err != cudaSuccess) {
		(void)cudaGetLastError();
		return -(int)err;
	}
	return major * 10 + minor;
#endif
}

extern "C" const char *sl_gpu_error_string(int err)
{
	return cudaGetErrorString((cudaError_t)err);
}

extern "C" int sl_codelet_has_cuda(int codelet)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	return c ? c->cuda_run != NULL : -EINVAL;
}

extern "C" int sl_codelet_run_cuda(int codelet, void *const *ptr, const size_t *count,
				   const size_t *elemsize, int n, const void *args, int tf32)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	if (!c || sl_codelet_check_count(c, n, sl_codelet_repeats(c, args)) != 0)
		return -EINVAL;
	if (!c->cuda_run)
		return -ENOSYS;
	if (!sl_gpu_emulated() && sl_gpu_devices() < 1)
		return -ENODEV;
	/* one stream, cuBLAS handle and scratch for the process's direct runs, as a worker's;
	 * the lock makes two threads' runs (the server's engine thread and another, say) take
	 * them in turn: at once they would share the scratch, and the emulation's state */
	static std::mutex direct;
	std::lock_guard<std::mutex> hold(direct);
	static cudaStream_t stream;
	static cublasHandle_t blas;
	static void *scratch;
	if (!blas) {
		SL_CUDA_CHECK(cudaStreamCreate(&stream));
		SL_CUBLAS_CHECK(cublasCreate(&blas));
		SL_CUBLAS_CHECK(cublasSetStream(blas, stream));
		scratch = sl_gpu_scratch_create();
	}
	struct sl_buf *b = (struct sl_buf *)calloc((size_t)(n ? n : 1), sizeof *b);
	if (!b)
		return -ENOMEM;
	for (int i = 0; i < n; i++) {
		b[i].ptr = NULL;
		b[i].n = count[i];
		b[i].elemsize = elemsize[i];
		if (ptr[i]) {
			SL_CUDA_CHECK(cudaMalloc(&b[i].ptr, count[i] * elemsize[i]));
			SL_CUDA_CHECK(cudaMemcpy(b[i].ptr, ptr[i], count[i] * elemsize[i],
						 cudaMemcpyHostToDevice));
		}
	}
	struct sl_gpu g = { (void *)stream, (void *)blas, tf32, scratch };
	c->cuda_run(b, n, args, &g);
	SL_CUDA_CHECK(cudaGetLastError());
	SL_CUDA_CHECK(cudaStreamSynchronize(stream));
	/* back only what the task writes: a buffer given twice (in place) gets the result */
	int k = sl_codelet_repeats(c, args);
	for (int i = 0; i < n; i++) {
		if (!b[i].ptr)
			continue;
		if (SL_MODE_KIND(c->modes[sl_codelet_declared(c, k, i)]) != SL_R)
			SL_CUDA_CHECK(cudaMemcpy(ptr[i], b[i].ptr, count[i] * elemsize[i],
						 cudaMemcpyDeviceToHost));
		SL_CUDA_CHECK(cudaFree(b[i].ptr));
	}
	free(b);
	return 0;
}

#ifndef SL_CUDA_EMULATION
extern "C" void *sl_gpu_event_record(void *stream, int *device)
{
	cudaEvent_t ev;
	if (cudaEventCreate(&ev) != cudaSuccess) {
		(void)cudaGetLastError();
		return NULL;
	}
	if (cudaEventRecord(ev, (cudaStream_t)stream) != cudaSuccess ||
	    (device && cudaGetDevice(device) != cudaSuccess)) {
		(void)cudaEventDestroy(ev);
		(void)cudaGetLastError();
		return NULL;
	}
	return ev;
}

extern "C" int sl_gpu_event_times(void **events, const int *devices, int n,
				  int64_t (*now_ns)(void), int64_t *ns)
{
	int timed = 0, cur = -1;
	if (cudaGetDevice(&cur) != cudaSuccess)
		(void)cudaGetLastError();
	for (int i = 0; i < n; i++)
		ns[i] = 0;
	for (int i = 0; i < n; i++) {
		if (!events[i])	/* none, or timed with its device's below */
			continue;
		/* every event of this device against one event of "now" on it: a stream of our
		 * own, non-blocking, so that the event completes as soon as it is recorded */
		const int dev = devices[i];
		cudaStream_t s = NULL;
		cudaEvent_t now = NULL;
		int64_t host = 0;
		if (cudaSetDevice(dev) == cudaSuccess &&
		    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
		    cudaEventCreate(&now) == cudaSuccess && cudaEventRecord(now, s) == cudaSuccess &&
		    cudaEventSynchronize(now) == cudaSuccess)
			host = now_ns();
		for (int j = i; j < n; j++) {
			if (!events[j] || devices[j] != dev)
				continue;
			float ms;
			cudaEvent_t ev = (cudaEvent_t)events[j];
			if (host && cudaEventSynchronize(ev) == cudaSuccess &&
			    cudaEventElapsedTime(&ms, ev, now) == cudaSuccess) {
				ns[j] = host - (int64_t)((double)ms * 1e6);
				timed++;
			}
			(void)cudaEventDestroy(ev);
			events[j] = NULL;
		}
		if (now)
			(void)cudaEventDestroy(now);
		if (s)
			(void)cudaStreamDestroy(s);
		(void)cudaGetLastError();
	}
	if (cur >= 0)
		(void)cudaSetDevice(cur);
	return timed;
}
#endif
