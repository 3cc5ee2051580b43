/* The task trace: a buffer of events, one per task run, each with its codelet, worker, cores,
 * times and the handles and access modes StarPU gave the task. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "internal.h"

static struct sl_trace_event *trace_buf;
static int dry_run;

void sl_set_dry_run(int on) { __atomic_store_n(&dry_run, on != 0, __ATOMIC_RELEASE); }

int sl_dry_run(void) { return __atomic_load_n(&dry_run, __ATOMIC_ACQUIRE); }
static size_t trace_cap;
static size_t trace_next; /* atomically incremented slot counter */

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Frees the recorded events' buffer lists and CUDA events (no task records while this runs). */
static void free_buffer_lists(void)
{
	size_t n = sl_trace_count();
	(void)sl_trace_gpu_times();
	for (size_t i = 0; i < n; i++)
		free(trace_buf[i].handles); /* one allocation with the modes */
}

int sl_trace_enable(size_t capacity)
{
	if (trace_buf)
		free_buffer_lists();
	free(trace_buf);
	trace_buf = NULL;
	trace_cap = 0;
	trace_next = 0;
	if (capacity == 0)
		return 0;
	trace_buf = calloc(capacity, sizeof *trace_buf);
	if (!trace_buf)
		return -12; /* -ENOMEM */
	trace_cap = capacity;
	return 0;
}

size_t sl_trace_count(void)
{
	size_t n = __atomic_load_n(&trace_next, __ATOMIC_ACQUIRE);
	return n < trace_cap ? n : trace_cap;
}

const struct sl_trace_event *sl_trace_events(void) { return trace_buf; }

long sl_trace_begin(int codelet, int ncores)
{
	if (!trace_buf)
		return -1;
	size_t slot = __atomic_fetch_add(&trace_next, 1, __ATOMIC_ACQ_REL);
	if (slot >= trace_cap)
		return -1;
	struct sl_trace_event *e = &trace_buf[slot];
	e->codelet = codelet;
	e->worker = starpu_worker_get_id();
	e->ncores = ncores;
	e->start_ns = now_ns();
	return (long)slot;
}

/* A StarPU access mode as SL_ACCESS_* bits. */
static int32_t access_bits(enum starpu_data_access_mode m)
{
	if (m & STARPU_REDUX)
		return SL_ACCESS_REDUX;
	return ((m & STARPU_R) ? SL_ACCESS_R : 0) |
	       ((m & (STARPU_W | STARPU_SCRATCH)) ? SL_ACCESS_W : 0);
}

/* The handles and modes of the running task, as StarPU holds them. StarPU calls a reduction's
 * init method inline inside the task that first touches the per-worker copy: the current task
 * is then that other task, recognised by its codelet name, and nothing is recorded. */
static void trace_buffers(struct sl_trace_event *e)
{
	struct starpu_task *task = starpu_task_get_current();
	e->nbuffers = -1;
	if (!task || !task->cl || !task->cl->name ||
	    strcmp(task->cl->name, sl_codelet_name(e->codelet)) != 0)
		return;
	int n = STARPU_TASK_GET_NBUFFERS(task);
	/* the handles first: they are the larger-aligned */
	sl_handle *handles = malloc((size_t)(n > 0 ? n : 1) * (sizeof *handles + sizeof(int32_t)));
	if (!handles) {
		fprintf(stderr, "starpu_llm: out of memory for the task trace\n");
		abort();
	}
	e->handles = handles;
	e->modes = (int32_t *)(handles + n);
	e->nbuffers = n;
	e->flops = task->flops;
	e->job = task->tag_id; /* sl_submit's submission number */
	e->priority = task->priority;
	e->nbytes = 0;
	for (int i = 0; i < n; i++) {
		e->handles[i] = STARPU_TASK_GET_HANDLE(task, i);
		e->modes[i] = access_bits(STARPU_TASK_GET_MODE(task, i));
		e->nbytes += (int64_t)starpu_data_get_size(e->handles[i]);
	}
}

void sl_trace_end(long slot)
{
	if (slot < 0 || !trace_buf)
		return;
	trace_buf[slot].end_ns = now_ns();
	trace_buffers(&trace_buf[slot]);
}

#ifdef SL_HAVE_CUDA
#include "../cuda/cuda_kernels.h"

/* A CUDA task's kernels, timed on the GPU: an event on the worker's stream before its body
 * queues them and one after (codelet_cuda), resolved to host times later. */
void sl_trace_gpu_mark(long slot, void *stream, int end)
{
	if (slot < 0 || !trace_buf)
		return;
	struct sl_trace_event *e = &trace_buf[slot];
	void *ev = sl_gpu_event_record(stream, end ? NULL : &e->gpu_device);
	__atomic_store_n(&e->gpu_events[end != 0], ev, __ATOMIC_RELEASE);
}

int sl_trace_gpu_times(void)
{
	size_t n = sl_trace_count(), k = 0;
	void **ev = malloc(2 * (n > 0 ? n : 1) * sizeof *ev);
	int *dev = malloc(2 * (n > 0 ? n : 1) * sizeof *dev);
	int64_t *ns = malloc(2 * (n > 0 ? n : 1) * sizeof *ns);
	size_t *slot = malloc((n > 0 ? n : 1) * sizeof *slot);
	int timed = 0;
	if (!ev || !dev || !ns || !slot)
		goto out; /* the events stay for a later call */
	for (size_t i = 0; i < n; i++) {
		struct sl_trace_event *e = &trace_buf[i];
		/* a task still running has no end event yet: left for a later call */
		void *a = __atomic_load_n(&e->gpu_events[0], __ATOMIC_ACQUIRE);
		void *b = __atomic_load_n(&e->gpu_events[1], __ATOMIC_ACQUIRE);
		if (!a || !b)
			continue;
		ev[2 * k] = a;
		ev[2 * k + 1] = b;
		dev[2 * k] = dev[2 * k + 1] = e->gpu_device;
		e->gpu_events[0] = e->gpu_events[1] = NULL;
		slot[k++] = i;
	}
	if (k > 0)
		sl_gpu_event_times(ev, dev, (int)(2 * k), now_ns, ns);
	for (size_t j = 0; j < k; j++) {
		struct sl_trace_event *e = &trace_buf[slot[j]];
		if (ns[2 * j] && ns[2 * j + 1]) {
			e->gpu_start_ns = ns[2 * j];
			e->gpu_end_ns = ns[2 * j + 1];
			timed++;
		}
	}
out:
	free(ev);
	free(dev);
	free(ns);
	free(slot);
	return timed;
}
#else
int sl_trace_gpu_times(void) { return 0; }
#endif
