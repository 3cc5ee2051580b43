/* The one insert path of every task, plain StarPU or StarPU-MPI: the handles and modes of the
 * codelet's declaration, the task's arguments (owned here), its flop count and where it runs,
 * given by the caller. */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#ifdef SL_HAVE_MPI
#include <starpu_mpi.h>
#endif

/* ---- task arguments ---- */

/* Task arguments are owned here, not by StarPU: a parallel task under peager runs as
 * starpu_task_dup() aliases that would each free a StarPU-owned cl_arg while the master still
 * reads it. Arguments live in a list freed once every task submitted before has completed. */
struct sl_args_block {
	struct sl_args_block *next;
	max_align_t data[];
};
static struct sl_args_block *args_list;
static pthread_mutex_t args_lock = PTHREAD_MUTEX_INITIALIZER;

static void *args_copy(const void *args, size_t size)
{
	struct sl_args_block *b = malloc(sizeof *b + size);
	if (!b) {
		fprintf(stderr, "starpu_llm: out of memory for task arguments\n");
		abort();
	}
	memcpy(b->data, args, size);
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

/* ---- submission ---- */

static int check_submit(int ret, const char *what)
{
	if (ret != 0)
		fprintf(stderr, "starpu_llm: submitting %s failed: %s (%d)\n", what,
			ret == -ENODEV ? "no worker can run it" : strerror(-ret), ret);
	return ret;
}

/* The handles against the declaration (sl_codelet_check_count, for repeat count k): every
 * buffer but trailing optional ones given, each repeated one k times. Returns 0 or -EINVAL. */
static int check_handles(const struct sl_codelet *c, const sl_handle *handles, int n, int k)
{
	if (sl_codelet_check_count(c, n, k) != 0)
		return -EINVAL;
	for (int i = 0; i < n; i++)
		if (!handles[i])
			return -EINVAL;
	return 0;
}

/* Each task carries its submission number as its tag id (STARPU_TAG_ONLY: a label for the
 * trace, no tag dependency) and the priority it is given (STARPU_PRIORITY). Under StarPU-MPI
 * every process submits every task:
 * starpu_mpi_task_insert runs it on `node` (or on the owner of what it writes) and posts the
 * transfers its data need. */
static uint64_t submitted;

long long sl_submitted(void) { return (long long)__atomic_load_n(&submitted, __ATOMIC_RELAXED); }

int sl_submit(int codelet, const sl_handle *handles, int n, int redux, const void *args,
	      size_t args_size, int node, int worker, int priority)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	struct starpu_codelet *cl = sl_starpu_codelet(codelet);
	if (!c || !cl)
		return check_submit(-EINVAL, c ? c->name : "an unknown codelet");
	if (args_size != (args ? c->args_size : 0) || node < SL_NODE_OWNER ||
	    worker < SL_ANY_WORKER)
		return check_submit(-EINVAL, c->name);
	int k = sl_codelet_repeats(c, args);
	if (check_handles(c, handles, n, k) != 0)
		return check_submit(-EINVAL, c->name);
	/* on the stack up to the declared maximum; only repeated buffers go beyond it (the gather
	 * of a checkpoint snapshot: every parameter tensor; wte's row blocks) */
	struct starpu_data_descr stack_buffers[SL_MAX_BUFFERS], *buffers = stack_buffers;
	size_t stack_count[SL_MAX_BUFFERS], *count = stack_count;
	if (n > SL_MAX_BUFFERS) {
		buffers = malloc((size_t)n * sizeof *buffers);
		count = malloc((size_t)n * sizeof *count);
		if (!buffers || !count) {
			free(buffers);
			free(count);
			return check_submit(-ENOMEM, c->name);
		}
	}
	int accumulate = sl_codelet_accumulate(c, args);
	for (int i = 0; i < n; i++) {
		int decl = c->modes[sl_codelet_declared(c, k, i)];
		buffers[i].handle = handles[i];
		buffers[i].mode = sl_starpu_mode(sl_mode_access(decl, redux, accumulate));
		count[i] = (decl & SL_ANY) ? 0 : starpu_vector_get_nx(handles[i]);
	}
	double flops = sl_codelet_flops(codelet, count, n, args);
	void *a = args_size ? args_copy(args, args_size) : NULL;
	starpu_tag_t seq = (starpu_tag_t)__atomic_fetch_add(&submitted, 1, __ATOMIC_RELAXED);
	int ret;
#ifdef SL_HAVE_MPI
	const void *comm = sl_mpi_comm();
	if (comm)
		ret = starpu_mpi_task_insert(
			*(const MPI_Comm *)comm, cl, STARPU_EXECUTE_ON_NODE, node,
			STARPU_EXECUTE_ON_WORKER, worker, STARPU_DATA_MODE_ARRAY, buffers, n,
			STARPU_CL_ARGS_NFREE, a, args_size, STARPU_FLOPS, flops, STARPU_TAG_ONLY, seq,
			STARPU_PRIORITY, priority, 0);
	else
#endif
		ret = starpu_task_insert(cl, STARPU_EXECUTE_ON_WORKER, worker,
					 STARPU_DATA_MODE_ARRAY, buffers, n, STARPU_CL_ARGS_NFREE,
					 a, args_size, STARPU_FLOPS, flops, STARPU_TAG_ONLY, seq,
					 STARPU_PRIORITY, priority, 0);
	if (buffers != stack_buffers) {
		free(buffers);
		free(count);
	}
	return check_submit(ret, c->name);
}
