/* StarPU-MPI glue: start on mpi4py's communicator, register handles with owner and tag, bring
 * a handle to a rank, read the traffic counters. Tasks are inserted by submit.c. Built without MPI, every
 * MPI entry point says -ENOSYS. The gradients' reduction across ranks is a task flow
 * (taskflow.reduce_gradients), not starpu_mpi_redux_data (see placement.py). */
#include <errno.h>
#include "internal.h"

#ifdef SL_HAVE_MPI
#include <starpu_mpi.h>

static int sl_mpi_active;
static MPI_Comm sl_mpi_comm_;

int sl_mpi_available(void) { return 1; }

const void *sl_mpi_comm(void) { return sl_mpi_active ? &sl_mpi_comm_ : NULL; }

int sl_mpi_start(struct starpu_conf *conf, const void *comm)
{
	int provided = 0;
	MPI_Query_thread(&provided);
	if (provided < MPI_THREAD_SERIALIZED)
		return -EPROTO; /* StarPU-MPI's thread calls MPI beside the application */
	sl_mpi_comm_ = *(const MPI_Comm *)comm;
	/* 0: MPI is already initialised (by mpi4py); StarPU is started with our conf */
	int ret = starpu_mpi_init_conf(NULL, NULL, 0, sl_mpi_comm_, conf);
	if (ret == 0)
		sl_mpi_active = 1;
	return ret;
}

int sl_mpi_stop(void)
{
	if (!sl_mpi_active)
		return 1;
	int ret = starpu_mpi_shutdown();
	sl_mpi_active = 0;
	return ret > 0 ? -ret : ret; /* never 1: StarPU is stopped */
}

int sl_mpi_rank(void)
{
	int r = 0;
	if (sl_mpi_active)
		starpu_mpi_comm_rank(sl_mpi_comm_, &r);
	return r;
}

int sl_mpi_size(void)
{
	int n = 1;
	if (sl_mpi_active)
		starpu_mpi_comm_size(sl_mpi_comm_, &n);
	return n;
}

int sl_mpi_register(sl_handle h, int64_t tag, int owner)
{
	if (!sl_mpi_active)
		return -EINVAL;
	starpu_mpi_data_register_comm(h, (starpu_mpi_tag_t)tag, owner, sl_mpi_comm_);
	return 0;
}

int sl_mpi_wait_all(void) { return starpu_mpi_wait_for_all(sl_mpi_comm_); }

int sl_mpi_fetch(sl_handle h, int node)
{
	if (!sl_mpi_active)
		return -EINVAL;
	/* void on 1.3, int on 1.4 */
	starpu_mpi_get_data_on_node_detached(sl_mpi_comm_, h, node, NULL, NULL);
	return 0;
}

int sl_mpi_bytes_sent(size_t *sent)
{
	if (!sl_mpi_active)
		return -EINVAL;
	int n = sl_mpi_size();
	/* StarPU leaves the array alone when its statistics are off: a sentinel tells */
	for (int r = 0; r < n; r++)
		sent[r] = (size_t)-1;
#if STARPU_MAJOR_VERSION > 1 || STARPU_MINOR_VERSION >= 4
	starpu_mpi_comm_stats_retrieve(sent);
#else
	starpu_mpi_comm_amounts_retrieve(sent);
#endif
	for (int r = 0; r < n; r++)
		if (sent[r] == (size_t)-1)
			return -ENODATA;
	return 0;
}

/* The largest data tag: StarPU-MPI's (starpu_mpi_comm_get_attr, STARPU_MPI_TAG_UB; INT64_MAX),
 * not MPI's MPI_TAG_UB: a handle's tag travels in StarPU-MPI's envelope, and its messages go
 * under StarPU-MPI's own few MPI tags (mpi/src/mpi/starpu_mpi_mpi.c: _STARPU_MPI_TAG_DATA,
 * _STARPU_MPI_TAG_ENVELOPE), so an MPI whose MPI_TAG_UB is small (32767 is the least the
 * standard guarantees) limits nothing. */
int64_t sl_mpi_tag_ub(void)
{
	int64_t *ub = NULL;
	int flag = 0;
	starpu_mpi_comm_get_attr(sl_mpi_comm_, STARPU_MPI_TAG_UB, &ub, &flag);
	return flag && ub ? *ub : 32767;
}

#else /* no MPI in this build */

int sl_mpi_available(void) { return 0; }
const void *sl_mpi_comm(void) { return NULL; }
int sl_mpi_start(struct starpu_conf *conf, const void *comm)
{
	(void)conf;
	(void)comm;
	return -ENOSYS;
}
int sl_mpi_stop(void) { return 1; }
int sl_mpi_rank(void) { return 0; }
int sl_mpi_size(void) { return 1; }
int sl_mpi_register(sl_handle h, int64_t t, int o)
{
	(void)h;
	(void)t;
	(void)o;
	return -ENOSYS;
}
int sl_mpi_wait_all(void) { return -ENOSYS; }
int64_t sl_mpi_tag_ub(void) { return 0; }
int sl_mpi_fetch(sl_handle h, int node)
{
	(void)h;
	(void)node;
	return -ENOSYS;
}
int sl_mpi_bytes_sent(size_t *sent)
{
	(void)sent;
	return -ENOSYS;
}

#endif
