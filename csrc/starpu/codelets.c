/* A StarPU codelet for every codelet of the table (csrc/codelets/): its CPU function, its
 * history perf model "sl_<name>", its access modes when they are fixed, and the cores it runs
 * on; and the one CPU entry of every task (team size, trace, dry run, the body). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

static struct starpu_codelet cls[SL_MAX_CODELETS];
static struct starpu_perfmodel models[SL_MAX_CODELETS];
static char symbols[SL_MAX_CODELETS][64];
static int built;
/* the methods of every gradient reduction: init = the zero codelet, reduce = the add codelet
 * (found once, by build) */
static struct starpu_codelet *reduce_add, *reduce_zero;

enum starpu_data_access_mode sl_starpu_mode(int32_t access)
{
	if (access & SL_ACCESS_REDUX)
		return STARPU_REDUX;
	if ((access & SL_ACCESS_R) && (access & SL_ACCESS_W))
		return STARPU_RW;
	return (access & SL_ACCESS_W) ? STARPU_W : STARPU_R;
}

/* The buffers of the running task as the body sees them (k: its repeat count). A buffer of
 * mode SL_ANY may have any interface: no pointer. */
static void task_buffers(const struct sl_codelet *c, int k, void *buffers[], int n,
			 struct sl_buf *b)
{
	for (int i = 0; i < n; i++) {
		int decl = c->modes[sl_codelet_declared(c, k, i)];
		if (decl & SL_ANY) {
			b[i] = (struct sl_buf){ NULL, 0, 0 };
			continue;
		}
		b[i] = (struct sl_buf){ (void *)STARPU_VECTOR_GET_PTR(buffers[i]),
					STARPU_VECTOR_GET_NX(buffers[i]),
					STARPU_VECTOR_GET_ELEMSIZE(buffers[i]) };
	}
}

/* Every task's CPU function calls this: the team of the worker's cores, the trace record
 * around the body (skipped in a dry run). The buffer count is the codelet's when fixed; else
 * the running task's (a reduction method, run inline inside another task, has fixed ones). */
static void codelet_cpu(const struct sl_codelet *c, void *buffers[], void *cl_arg)
{
	long slot = sl_trace_begin(c->id, sl_task_threads());
	if (!sl_dry_run()) {
		const struct starpu_codelet *cl = &cls[c->id];
		int n = cl->nbuffers != STARPU_VARIABLE_NBUFFERS ?
				cl->nbuffers :
				(int)STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
		struct sl_buf b[n > 0 ? n : 1];
		task_buffers(c, sl_codelet_repeats(c, cl_arg), buffers, n, b);
		c->run(b, n, cl_arg);
	}
	sl_trace_end(slot);
}

/* Fixed when every buffer's mode is (R, W or RW, none optional or repeated): StarPU then gets
 * them with the codelet; else each task brings its own. */
static int fixed_modes(const struct sl_codelet *c)
{
	for (int i = 0; i < c->nbuffers; i++) {
		int m = c->modes[i];
		if (m != SL_R && m != SL_W && m != SL_RW)
			return 0;
	}
	return 1;
}

static int codelet_id(const char *name)
{
	for (int id = 0; id < sl_codelet_count(); id++)
		if (strcmp(sl_codelet_name(id), name) == 0)
			return id;
	return -1;
}

static void build(void)
{
	int count = sl_codelet_count();
	if (count > SL_MAX_CODELETS) {
		fprintf(stderr, "starpu_llm: %d codelets, room for %d\n", count,
			SL_MAX_CODELETS);
		abort();
	}
	for (int id = 0; id < count; id++) {
		const struct sl_codelet *c = sl_codelet_get(id);
		struct starpu_codelet *cl = &cls[id];
		starpu_codelet_init(cl);
		cl->cpu_funcs[0] = c->cpu;
		cl->cpu_funcs_name[0] = c->name;
		cl->name = c->name;
		if (!(c->flags & SL_NO_PERFMODEL)) {
			snprintf(symbols[id], sizeof symbols[id], "sl_%s", c->name);
			models[id] = (struct starpu_perfmodel){ .type = STARPU_HISTORY_BASED,
								.symbol = symbols[id] };
			cl->model = &models[id];
		}
		if (fixed_modes(c)) {
			cl->nbuffers = c->nbuffers;
			for (int i = 0; i < c->nbuffers; i++)
				cl->modes[i] = sl_starpu_mode(sl_mode_access(c->modes[i], 0, 0));
		} else {
			cl->nbuffers = STARPU_VARIABLE_NBUFFERS;
		}
	}
	sl_codelet_cpu = codelet_cpu;
	built = 1;
	reduce_add = sl_starpu_codelet(codelet_id("add"));
	reduce_zero = sl_starpu_codelet(codelet_id("zero"));
}

_Static_assert(SL_MAX_BUFFERS <= STARPU_NMAXBUFS, "a codelet's modes must fit in starpu_codelet");

void sl_codelets_setup(int cores_per_worker)
{
	if (!built)
		build();
	for (int id = 0; id < sl_codelet_count(); id++) {
		if (sl_codelet_get(id)->flags & SL_SEQUENTIAL)
			continue;
		cls[id].type = cores_per_worker > 1 ? STARPU_FORKJOIN : STARPU_SEQ;
		cls[id].max_parallelism = cores_per_worker;
	}
}

struct starpu_codelet *sl_starpu_codelet(int codelet)
{
	return built && codelet >= 0 && codelet < sl_codelet_count() ? &cls[codelet] : NULL;
}

int sl_set_grad_reduction(sl_handle h)
{
	if (!reduce_add || !reduce_zero)
		return -EINVAL;
	starpu_data_set_reduction_methods(h, reduce_add, reduce_zero);
	return 0;
}
