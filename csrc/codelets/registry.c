/* The codelet table: codelets by id with their declared access modes, cores per task, task
 * arguments, and the one submission path every submit helper takes. */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "codelet.h"
#include "../internal.h"

static struct sl_codelet *codelets[SL_CL_COUNT];

#define SL_ID_NAME(name) #name,
static const char *codelet_names[] = { SL_CODELET_NAMES(SL_ID_NAME) };
#undef SL_ID_NAME

const char *sl_codelet_name(int codelet)
{
	return (codelet >= 0 && codelet < SL_CL_COUNT) ? codelet_names[codelet] : "?";
}

int sl_codelet_count(void) { return SL_CL_COUNT; }

int sl_codelet_sequential(int codelet)
{
	return codelet >= 0 && codelet < SL_CL_COUNT && codelets[codelet] ?
		       codelets[codelet]->sequential :
		       -1;
}

/* ---- the table ---- */

_Static_assert(SL_MAX_BUFFERS <= STARPU_NMAXBUFS, "a codelet's modes must fit in starpu_codelet");

static int fixed_mode(int mode) { return mode == SL_R || mode == SL_W || mode == SL_RW; }

void sl_codelet_register(struct sl_codelet *c)
{
	int fixed = 1;
	for (int i = 0; i < c->nbuffers; i++)
		fixed = fixed && fixed_mode(c->modes[i]);
	if (fixed) {
		c->cl.nbuffers = c->nbuffers;
		for (int i = 0; i < c->nbuffers; i++)
			c->cl.modes[i] = sl_mode_resolve(c->modes[i], 0, 0);
	} else {
		/* modes or the buffer count vary: they come with each task */
		c->cl.nbuffers = STARPU_VARIABLE_NBUFFERS;
	}
	codelets[c->id] = c;
}

/* Every codelet runs on k cores: FORKJOIN on combined workers of size k, or SEQ for k = 1. */
void sl_codelets_set_cores(int k)
{
	for (int i = 0; i < SL_CL_COUNT; i++) {
		if (!codelets[i] || codelets[i]->sequential)
			continue;
		codelets[i]->cl.type = k > 1 ? STARPU_FORKJOIN : STARPU_SEQ;
		codelets[i]->cl.max_parallelism = k;
	}
}

enum starpu_data_access_mode sl_mode_resolve(int mode, int redux, int accumulate)
{
	switch (mode & ~SL_OPT) {
	case SL_R:
		return STARPU_R;
	case SL_W:
		return STARPU_W;
	case SL_GRAD:
		return redux ? STARPU_REDUX : STARPU_RW;
	case SL_ACC:
		return accumulate ? STARPU_RW : STARPU_W;
	default:
		return STARPU_RW;
	}
}

int sl_codelet_modes(int codelet, int redux, int accumulate, int32_t *modes, int max)
{
	if (codelet < 0 || codelet >= SL_CL_COUNT || !codelets[codelet])
		return -EINVAL;
	const struct sl_codelet *c = codelets[codelet];
	for (int i = 0; i < c->nbuffers && i < max; i++)
		modes[i] = sl_access_bits(sl_mode_resolve(c->modes[i], redux, accumulate)) |
			   ((c->modes[i] & SL_OPT) ? SL_ACCESS_OPTIONAL : 0);
	return c->nbuffers;
}

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

int sl_submit(struct sl_codelet *c, const sl_handle *handles, int nhandles, int redux,
	      int accumulate, const void *args, size_t args_size, double flops)
{
	/* NULL trailing handles leave out optional trailing buffers (matmul's bias), as does a
	 * shorter list (norm_sum's inputs) */
	while (nhandles > 0 && nhandles <= c->nbuffers && !handles[nhandles - 1] &&
	       (c->modes[nhandles - 1] & SL_OPT))
		nhandles--;
	if (nhandles > SL_MAX_BUFFERS || nhandles > c->nbuffers)
		return check_submit(-EINVAL, c->cl.name);
	for (int i = nhandles; i < c->nbuffers; i++)
		if (!(c->modes[i] & SL_OPT))
			return check_submit(-EINVAL, c->cl.name);
	struct starpu_data_descr buffers[SL_MAX_BUFFERS];
	for (int i = 0; i < nhandles; i++) {
		if (!handles[i])
			return check_submit(-EINVAL, c->cl.name);
		buffers[i].handle = handles[i];
		buffers[i].mode = sl_mode_resolve(c->modes[i], redux, accumulate);
	}
	void *a = args_size ? args_copy(args, args_size) : NULL;
	return check_submit(
		sl_insert_task(sl_task_placement(), &c->cl, buffers, nhandles, a, args_size, flops),
		c->cl.name);
}
