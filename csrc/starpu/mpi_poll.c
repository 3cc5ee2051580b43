/* How StarPU-MPI's progression thread waits: spinning, or backing off when polls find nothing.
 *
 * Why: the thread (named "MPI", StarPU 1.3 and 1.4: mpi/src/mpi/starpu_mpi_mpi.c) loops on
 * MPI_Test for as long as any request is pending, and in a training step one always is: a
 * receive is posted as soon as the task that needs its data is submitted, long before the
 * sender has computed it. Where the thread has a core of its own (a cluster node with a core
 * kept for it) that costs nothing. Where it shares a worker's core (one core per rank, or
 * every core a worker) the scheduler gives it half of that core: measured on 2 one-core
 * ranks, the thread used as much CPU as the worker (sharded ownership) and the step took
 * 1.5 times as long.
 *
 * How: MPI's profiling interface lets a library define MPI_Test and call the real one as
 * PMPI_Test. Ours is bound by libstarpumpi when this module is loaded before MPI's library
 * is made global (mpi4py makes it so): the module's own definition comes first in the
 * lookup of the libraries it loads. In the progression thread only, with backoff on, a poll
 * that finds nothing and took no time (moved no data) is followed, once the thread has
 * polled for SPIN_NS without news, by a sleep of backoff_ns, doubled after each such sleep
 * up to max_ns and reset to MIN_NS by any completed request or any poll that moved data.
 * After a sleep the thread polls for RESPIN_NS only (one pass over its pending requests)
 * before the next: polling a whole SPIN_NS after every sleep kept it busy 20 us of every
 * ~250 (measured on 2 one-core ranks, sharded: 9-10 % of the worker's core in user time).
 * A message is thus noticed at most max_ns late; the thread sleeps while the worker runs.
 * Every other thread and every other MPI call are untouched. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include "internal.h"

#define SPIN_NS 20000L  /* polls without news before the first sleep */
#define MIN_NS 5000L    /* the first sleep */
#define BUSY_NS 20000L  /* a poll that took longer moved data: not idle */
#define RESPIN_NS 5000L /* polls after a sleep before the next one */

void sl_mpi_poll_reset(struct sl_poll_state *st)
{
	st->quiet_ns = 0;
	st->spin_ns = SPIN_NS;
	st->backoff_ns = MIN_NS;
}

long sl_mpi_poll_next(struct sl_poll_state *st, int news, long elapsed_ns, long max_ns)
{
	if (news) {
		sl_mpi_poll_reset(st);
		return 0;
	}
	st->quiet_ns += elapsed_ns;
	if (st->quiet_ns <= st->spin_ns)
		return 0;
	long sleep = st->backoff_ns < max_ns ? st->backoff_ns : max_ns;
	if (st->backoff_ns < max_ns)
		st->backoff_ns *= 2;
	st->quiet_ns = 0;
	st->spin_ns = RESPIN_NS;
	return sleep;
}

#ifdef SL_HAVE_MPI
#include <mpi.h>

static int interposed;                             /* libstarpumpi calls our MPI_Test */
static atomic_long max_ns;                         /* 0: spin (StarPU's own behaviour) */
static atomic_llong n_polls, n_sleeps, slept_ns;   /* the progression thread's, for tests */

static __thread int is_progress_thread = -1;       /* -1: not yet known */
static __thread struct sl_poll_state state;
static __thread struct timespec last;              /* the previous poll's end, or sleep's */

static long since(const struct timespec *a, const struct timespec *b)
{
	return (b->tv_sec - a->tv_sec) * 1000000000L + (b->tv_nsec - a->tv_nsec);
}

/* When this module is loaded (its libraries bound at once: Python loads extension modules
 * with RTLD_NOW), libstarpumpi's MPI_Test is ours unless MPI's library was global already
 * (mpi4py's MPI module imported first), in which case the global one came first. (Not
 * `global == MPI_Test`: inside the module that name too goes through the global lookup.) */
__attribute__((constructor)) static void find_who_starpu_calls(void)
{
	Dl_info global, here;
	void *f = dlsym(RTLD_DEFAULT, "MPI_Test");
	interposed = f == NULL || (dladdr(f, &global) && dladdr((void *)&since, &here) &&
				   global.dli_fbase == here.dli_fbase);
}

int sl_mpi_poll_backoff(int max_us)
{
	if (max_us < 0)
		return -EINVAL;
	if (max_us > 0 && !interposed)
		return -ENOTSUP;
	atomic_store(&max_ns, (long)max_us * 1000L);
	return 0;
}

void sl_mpi_poll_stats(long long *polls, long long *sleeps, long long *slept)
{
	*polls = atomic_load(&n_polls);
	*sleeps = atomic_load(&n_sleeps);
	*slept = atomic_load(&slept_ns);
}

__attribute__((visibility("default"))) int MPI_Test(MPI_Request *request, int *flag,
						     MPI_Status *status)
{
	if (is_progress_thread < 0) {
		char name[16] = "";
		pthread_getname_np(pthread_self(), name, sizeof name);
		is_progress_thread = strcmp(name, "MPI") == 0;
		sl_mpi_poll_reset(&state);
		clock_gettime(CLOCK_MONOTONIC, &last);
	}
	long max = atomic_load_explicit(&max_ns, memory_order_relaxed);
	if (!is_progress_thread || max == 0)
		return PMPI_Test(request, flag, status);

	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int ret = PMPI_Test(request, flag, status);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	atomic_fetch_add_explicit(&n_polls, 1, memory_order_relaxed);
	/* news: a completed request, or a poll that took long (it moved data) */
	long sleep = sl_mpi_poll_next(&state, ret != MPI_SUCCESS || *flag || since(&t0, &t1) > BUSY_NS,
				      since(&last, &t1), max);
	last = t1;
	if (sleep > 0) {
		struct timespec d = {0, sleep};
		nanosleep(&d, NULL);
		clock_gettime(CLOCK_MONOTONIC, &last);
		atomic_fetch_add_explicit(&n_sleeps, 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&slept_ns, since(&t1, &last), memory_order_relaxed);
	}
	return ret;
}

#else /* no MPI in this build */

int sl_mpi_poll_backoff(int max_us)
{
	(void)max_us;
	return -ENOSYS;
}

void sl_mpi_poll_stats(long long *polls, long long *sleeps, long long *slept)
{
	*polls = *sleeps = *slept = 0;
}

#endif
