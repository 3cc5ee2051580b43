/* Shared codelet machinery: cores per task, thread binding, task trace. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <stddef.h>
#include "codelet.h"
#include "blas_threads.h"

/* ---- threads ---- */

void sl_set_threads(int k)
{
	omp_set_num_threads(k);
	sl_blas_set_threads(k);
}

int sl_get_threads(void) { return omp_get_max_threads(); }

const char *sl_blas_name(void) { return sl_blas_library(); }

/* Bind each thread of a k-thread team to one core of the combined worker running the task.
 * Why: libgomp's pool threads keep the CPU mask they were created with, and StarPU only
 * rebinds the team's master thread (to the union of the cores) for a FORKJOIN task, so two
 * team threads could otherwise share a core. The pool threads of a master thread persist, so
 * they are bound once per (master thread, combined worker); the master every time, because
 * StarPU restores its own single-core binding after each parallel task. */
static __thread int bound_combined = -1;

/* Binds thread t (t > 0) of the calling thread's k-thread libgomp pool to core cpus[t]. */
static void bind_pool(const int *cpus, int k)
{
#pragma omp parallel num_threads(k)
	{
		int t = omp_get_thread_num();
		if (t > 0)
			starpu_sched_ctx_bind_current_thread_to_cpuid(cpus[t]);
	}
}

static void bind_team(int k)
{
	int cid = starpu_combined_worker_get_id();
	int size = 0, *ids = NULL;
	if (cid < 0 || starpu_combined_worker_get_description(cid, &size, &ids) != 0 || size < k)
		return;
	if (cid != bound_combined) {
		int cpus[SL_MAX_GROUP];
		for (int t = 0; t < k && t < SL_MAX_GROUP; t++)
			cpus[t] = starpu_worker_get_bindid(ids[t]);
		bind_pool(cpus, k);
		bound_combined = cid;
	}
	starpu_sched_ctx_bind_current_thread_to_cpuid(starpu_worker_get_bindid(ids[0]));
}

/* ---- trace ---- */

static struct sl_trace_event *trace_buf;
static size_t trace_cap;
static size_t trace_next;   /* atomically incremented slot counter */

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int sl_trace_enable(size_t capacity)
{
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

void sl_trace_reset(void) { __atomic_store_n(&trace_next, 0, __ATOMIC_RELEASE); }

#define SL_ID_NAME(id, name) name,
static const char *codelet_names[] = { SL_CODELET_IDS(SL_ID_NAME) };
#undef SL_ID_NAME

const char *sl_codelet_name(int codelet)
{
	return (codelet >= 0 && codelet < SL_CL_COUNT) ? codelet_names[codelet] : "?";
}

int sl_codelet_count(void) { return SL_CL_COUNT; }

/* ---- where tasks run ---- */

int sl_exec_worker = -1;

void sl_set_exec_worker(int worker) { sl_exec_worker = worker < 0 ? -1 : worker; }

/* ---- per task ---- */

static int team_from_runtime;

void sl_codelets_set_team_from_runtime(int on) { team_from_runtime = on; }

/* ---- team mode: a worker owns a group of k cores ---- */
static int team_k;
static int team_groups[STARPU_NMAXWORKERS][SL_MAX_GROUP];
static __thread int team_bound;   /* this worker's team threads are bound (once) */

void sl_codelets_set_team_groups(int nworkers, int k, const int *cores)
{
	team_k = nworkers > 0 ? k : 0;
	for (int w = 0; w < nworkers && w < STARPU_NMAXWORKERS; w++)
		for (int t = 0; t < k && t < SL_MAX_GROUP; t++)
			team_groups[w][t] = cores ? cores[w * k + t] : w * k + t;
}

/* libgomp keeps a pool of team threads per master thread: binding them once per worker
 * thread is enough, and the StarPU worker thread itself stays on its group's first core. */
static void bind_team_group(int k)
{
	if (team_bound)
		return;
	int w = starpu_worker_get_id();
	if (w < 0 || w >= STARPU_NMAXWORKERS)
		return;
	bind_pool(team_groups[w], k);
	team_bound = 1;
}

long sl_task_begin(int codelet_id)
{
	int k;
	if (team_from_runtime) {
		k = omp_get_max_threads();     /* the parallel worker's team, bound by StarPU */
		sl_blas_set_threads(k);
	} else if (team_k > 1) {
		k = team_k;
		sl_set_threads(k);
		bind_team_group(k);
	} else {
		k = starpu_combined_worker_get_size();   /* 1 on a basic worker */
		sl_set_threads(k);
		if (k > 1)
			bind_team(k);
	}
	if (!trace_buf)
		return -1;
	size_t slot = __atomic_fetch_add(&trace_next, 1, __ATOMIC_ACQ_REL);
	if (slot >= trace_cap)
		return -1;
	struct sl_trace_event *e = &trace_buf[slot];
	e->codelet = codelet_id;
	e->worker = starpu_worker_get_id();
	e->ncores = k;
	e->start_ns = now_ns();
	return (long)slot;
}

static int32_t access_bits(enum starpu_data_access_mode m)
{
	if (m & STARPU_REDUX)
		return SL_ACCESS_REDUX;
	return ((m & STARPU_R) ? SL_ACCESS_R : 0) | ((m & (STARPU_W | STARPU_SCRATCH)) ? SL_ACCESS_W : 0);
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
	e->nbuffers = n;
	for (int i = 0; i < n && i < SL_TRACE_MAXBUF; i++) {
		e->handles[i] = STARPU_TASK_GET_HANDLE(task, i);
		e->modes[i] = access_bits(STARPU_TASK_GET_MODE(task, i));
	}
}

void sl_task_end(long slot)
{
	if (slot < 0 || !trace_buf)
		return;
	trace_buf[slot].end_ns = now_ns();
	trace_buffers(&trace_buf[slot]);
}

/* ---- codelet table ---- */

#define SL_MAX_CODELETS 64
static struct starpu_codelet *codelets[SL_MAX_CODELETS];
static int ncodelets;

void sl_codelet_register(struct starpu_codelet *cl)
{
	for (int i = 0; i < ncodelets; i++)
		if (codelets[i] == cl)
			return;
	if (ncodelets < SL_MAX_CODELETS)
		codelets[ncodelets++] = cl;
}

/* Every codelet runs on k cores: FORKJOIN on combined workers of size k, or SEQ for k = 1. */
void sl_codelets_set_cores(int k)
{
	for (int i = 0; i < ncodelets; i++) {
		codelets[i]->type = k > 1 ? STARPU_FORKJOIN : STARPU_SEQ;
		codelets[i]->max_parallelism = k;
	}
}

/* Task arguments are owned here, not by StarPU: a parallel task under peager runs as
 * starpu_task_dup() aliases that would each free a StarPU-owned cl_arg while the master still
 * reads it. Arguments live in a list freed once every task submitted before has completed. */
struct sl_args_block { struct sl_args_block *next; max_align_t data[]; };
static struct sl_args_block *args_list;
static pthread_mutex_t args_lock = PTHREAD_MUTEX_INITIALIZER;

void *sl_args_alloc(size_t size)
{
	struct sl_args_block *b = malloc(sizeof *b + size);
	if (!b) {
		fprintf(stderr, "starpu_llm: out of memory for task arguments\n");
		abort();
	}
	pthread_mutex_lock(&args_lock);
	b->next = args_list;
	args_list = b;
	pthread_mutex_unlock(&args_lock);
	return b->data;
}

void sl_args_free_completed(void)
{
	pthread_mutex_lock(&args_lock);
	struct sl_args_block *b = args_list;
	args_list = NULL;
	pthread_mutex_unlock(&args_lock);
	while (b) {
		struct sl_args_block *next = b->next;
		free(b);
		b = next;
	}
}

int sl_check_submit(int ret, const char *what)
{
	if (ret != 0)
		fprintf(stderr, "starpu_llm: submitting %s failed: %s (%d)\n", what,
			ret == -ENODEV ? "no worker can run it" : strerror(-ret), ret);
	return ret;
}
