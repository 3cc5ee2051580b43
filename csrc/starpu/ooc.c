/* Out of core (--memory-limit): StarPU's cap on the main memory it allocates
 * (STARPU_LIMIT_CPU_MEM, read by starpu_init) and a disk memory node it evicts to
 * (starpu_disk_register), so that the handles StarPU allocated itself (home node -1) live in
 * main memory only while the cap allows and on disk otherwise; StarPU fetches them back for
 * the tasks that use them (prefetching those of the tasks that become ready).
 *
 * The disk node is StarPU's own unistd backend (its reads, writes, asynchronous requests and
 * bandwidth calibration) under a thin layer of ours that
 *   - counts the bytes read from and written to the disk (sl_ooc_traffic);
 *   - creates each object's file itself and reserves its blocks (posix_fallocate) before
 *     StarPU writes to it, then has unistd open it: a disk that fills up fails at that
 *     reservation, with errno, where unistd's own allocation (a sparse file) would let the
 *     write fail later inside StarPU (an assertion, an abort). Such a failure cannot be given
 *     back to StarPU (the data being evicted has nowhere to go): the process prints one error,
 *     removes its files and exits with status 2 (sl_ooc_fatal);
 *   - removes each file when StarPU frees its object (at unregistration, at shutdown).
 * Test hook: SL_OOC_TEST_FULL_AFTER=N makes the disk full once N bytes have been written to
 * it, as if another process had filled it (tests/test_offload.py). */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "internal.h"

static struct {
	size_t limit;	     /* bytes StarPU may allocate in main memory; 0: no limit */
	char dir[4096];	     /* the offload folder (ours alone: every file in it is ours) */
	int node;	     /* the disk memory node, -1 when none */
	int env_set;	     /* we set STARPU_LIMIT_CPU_MEM */
	size_t full_after;   /* test hook: bytes written before the disk counts as full */
	unsigned long files; /* files created so far (their names: sl-<n>) */
} ooc = { .node = -1 };

static uint64_t bytes_read, bytes_written;

/* The objects StarPU has on the disk, each with the number of its file. */
struct disk_file {
	void *obj;
	unsigned long id;
};
static struct disk_file *disk_files;
static size_t ndisk_files, disk_files_room;
static pthread_mutex_t disk_files_lock = PTHREAD_MUTEX_INITIALIZER;

static void file_path(char *out, size_t room, unsigned long id)
{
	snprintf(out, room, "%s/sl-%lu", ooc.dir, id);
}

/* Prints the error, removes the offload files and the folder, and ends the process: StarPU
 * cannot go on without the disk it evicts to. */
static void sl_ooc_fatal(const char *what, int err, size_t size)
{
	fprintf(stderr,
		"starpu-llm: error: %s (%zu bytes in the offload folder %s: %s); free space there "
		"or give --offload-dir on a larger disk, then --resume from the last checkpoint\n",
		what, size, ooc.dir, strerror(err));
	pthread_mutex_lock(&disk_files_lock);
	char path[sizeof ooc.dir + 32];
	for (size_t i = 0; i < ndisk_files; i++) {
		file_path(path, sizeof path, disk_files[i].id);
		unlink(path);
	}
	rmdir(ooc.dir);
	_exit(2);
}

static int remember(void *obj, unsigned long id)
{
	pthread_mutex_lock(&disk_files_lock);
	if (ndisk_files == disk_files_room) {
		size_t room = disk_files_room ? 2 * disk_files_room : 256;
		struct disk_file *more = realloc(disk_files, room * sizeof *more);
		if (!more) {
			pthread_mutex_unlock(&disk_files_lock);
			return -ENOMEM;
		}
		disk_files = more;
		disk_files_room = room;
	}
	disk_files[ndisk_files++] = (struct disk_file){ obj, id };
	pthread_mutex_unlock(&disk_files_lock);
	return 0;
}

/* The file number of obj, forgotten; -1 when unknown. */
static long forget(void *obj)
{
	long id = -1;
	pthread_mutex_lock(&disk_files_lock);
	for (size_t i = 0; i < ndisk_files; i++)
		if (disk_files[i].obj == obj) {
			id = (long)disk_files[i].id;
			disk_files[i] = disk_files[--ndisk_files];
			break;
		}
	pthread_mutex_unlock(&disk_files_lock);
	return id;
}

static void *disk_alloc(void *base, size_t size)
{
	unsigned long id = __atomic_fetch_add(&ooc.files, 1, __ATOMIC_RELAXED);
	char path[sizeof ooc.dir + 32], name[32];
	file_path(path, sizeof path, id);
	snprintf(name, sizeof name, "sl-%lu", id);
	int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		sl_ooc_fatal("cannot create a file for evicted data", errno, size);
	int err = size ? posix_fallocate(fd, 0, (off_t)size) : 0;
	close(fd);
	if (err) {
		unlink(path);
		sl_ooc_fatal("the disk is full: no room to evict data", err, size);
	}
	void *obj = starpu_disk_unistd_ops.open(base, name, size);
	if (!obj) {
		unlink(path);
		sl_ooc_fatal("cannot open a file for evicted data", errno, size);
	}
	if (remember(obj, id) != 0) {
		starpu_disk_unistd_ops.close(base, obj, size);
		unlink(path);
		sl_ooc_fatal("out of memory recording a file for evicted data", ENOMEM, size);
	}
	return obj;
}

static void disk_free(void *base, void *obj, size_t size)
{
	long id = forget(obj);
	starpu_disk_unistd_ops.close(base, obj, size);
	if (id >= 0) {
		char path[sizeof ooc.dir + 32];
		file_path(path, sizeof path, (unsigned long)id);
		unlink(path);
	}
}

static void count_written(size_t size)
{
	uint64_t total = __atomic_add_fetch(&bytes_written, size, __ATOMIC_RELAXED);
	if (ooc.full_after && total > ooc.full_after)
		sl_ooc_fatal("the disk is full: no room to evict data", ENOSPC, size);
}

static int disk_read(void *base, void *obj, void *buf, off_t offset, size_t size)
{
	__atomic_add_fetch(&bytes_read, size, __ATOMIC_RELAXED);
	return starpu_disk_unistd_ops.read(base, obj, buf, offset, size);
}

static int disk_write(void *base, void *obj, const void *buf, off_t offset, size_t size)
{
	count_written(size);
	return starpu_disk_unistd_ops.write(base, obj, buf, offset, size);
}

static void *disk_async_read(void *base, void *obj, void *buf, off_t offset, size_t size)
{
	__atomic_add_fetch(&bytes_read, size, __ATOMIC_RELAXED);
	return starpu_disk_unistd_ops.async_read(base, obj, buf, offset, size);
}

static void *disk_async_write(void *base, void *obj, void *buf, off_t offset, size_t size)
{
	count_written(size);
	return starpu_disk_unistd_ops.async_write(base, obj, buf, offset, size);
}

static int disk_full_read(void *base, void *obj, void **ptr, size_t *size, unsigned dst_node)
{
	int ret = starpu_disk_unistd_ops.full_read(base, obj, ptr, size, dst_node);
	__atomic_add_fetch(&bytes_read, *size, __ATOMIC_RELAXED);
	return ret;
}

static int disk_full_write(void *base, void *obj, void *ptr, size_t size)
{
	count_written(size);
	return starpu_disk_unistd_ops.full_write(base, obj, ptr, size);
}

static struct starpu_disk_ops disk_ops;

int sl_set_memory_limit(size_t bytes, const char *dir)
{
	if (sl_ooc_disk_node() >= 0)
		return -EALREADY;
	if (bytes && (!dir || strlen(dir) >= sizeof ooc.dir))
		return -EINVAL;
	ooc.limit = bytes;
	snprintf(ooc.dir, sizeof ooc.dir, "%s", bytes ? dir : "");
	return 0;
}

int sl_ooc_before_init(void)
{
	if (!ooc.limit) {
		/* the variable ours, from an earlier start of this process */
		if (ooc.env_set && unsetenv("STARPU_LIMIT_CPU_MEM") != 0)
			return -errno;
		ooc.env_set = 0;
		return 0;
	}
	/* StarPU reads a whole number of MiB; at least 1 */
	char mib[32];
	snprintf(mib, sizeof mib, "%zu", ooc.limit >> 20 ? ooc.limit >> 20 : 1);
	if (setenv("STARPU_LIMIT_CPU_MEM", mib, 1) != 0)
		return -errno;
	ooc.env_set = 1;
	/* A buffer StarPU frees (evicted) goes back to the system at once: every allocation of
	 * 128 KiB or more its own mapping. Without a fixed threshold glibc raises it to the
	 * size of the buffers freed, then serves them from heaps it keeps: RSS above the cap. */
	if (mallopt(M_MMAP_THRESHOLD, 128 * 1024) != 1)
		return -EINVAL;
	ooc.full_after = 0; /* set once the disk's calibration is done */
	return 0;
}

int sl_ooc_after_init(void)
{
	if (!ooc.limit)
		return 0;
	disk_ops = starpu_disk_unistd_ops;
	disk_ops.alloc = disk_alloc;
	disk_ops.free = disk_free;
	disk_ops.read = disk_read;
	disk_ops.write = disk_write;
	disk_ops.async_read = disk_async_read;
	disk_ops.async_write = disk_async_write;
	disk_ops.full_read = disk_full_read;
	disk_ops.full_write = disk_full_write;
	disk_ops.copy = NULL; /* one disk: no disk-to-disk copies */
	/* no size (-1): the folder's free space was checked for every tensor StarPU may evict,
	 * and each file's blocks are reserved when StarPU creates it */
	int node = starpu_disk_register(&disk_ops, ooc.dir, -1);
	if (node < 0)
		return node;
	ooc.node = node;
	/* the bandwidth calibration's traffic is no training's */
	__atomic_store_n(&bytes_read, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&bytes_written, 0, __ATOMIC_RELAXED);
	const char *full = getenv("SL_OOC_TEST_FULL_AFTER");
	ooc.full_after = full ? strtoull(full, NULL, 10) : 0;
	return 0;
}

void sl_ooc_after_shutdown(void) { ooc.node = -1; }

int sl_ooc_enabled(void) { return ooc.limit != 0; }

int sl_ooc_disk_node(void) { return ooc.node; }

void sl_ooc_traffic(uint64_t *read, uint64_t *written)
{
	*read = __atomic_load_n(&bytes_read, __ATOMIC_RELAXED);
	*written = __atomic_load_n(&bytes_written, __ATOMIC_RELAXED);
}

size_t sl_memory_used(void)
{
	starpu_ssize_t total = starpu_memory_get_total(STARPU_MAIN_RAM);
	starpu_ssize_t available = starpu_memory_get_available(STARPU_MAIN_RAM);
	return total < 0 || available < 0 ? 0 : (size_t)(total - available);
}
