/* The codelet table: every codelet declared with SL_CODELET registers itself here at library
 * load. StarPU-free: the reference engine reads and runs the same table. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "codelet.h"

static struct sl_codelet *table[SL_MAX_CODELETS];
static int count;

void (*sl_codelet_cpu)(const struct sl_codelet *c, void *buffers[], void *cl_arg);
void (*sl_codelet_cuda)(const struct sl_codelet *c, void *buffers[], void *cl_arg);

/* Whether a buffer of c is declared with (mode & mask) == value. */
static int has_buffer(const struct sl_codelet *c, int mask, int value)
{
	for (int i = 0; i < c->nbuffers; i++)
		if ((c->modes[i] & mask) == value)
			return 1;
	return 0;
}

/* A declaration that contradicts itself ends the program at library load. */
static void require(int ok, const struct sl_codelet *c, const char *what)
{
	if (!ok) {
		fprintf(stderr, "starpu_llm: codelet %s: %s\n", c->name, what);
		abort();
	}
}

void sl_codelet_register(struct sl_codelet *c)
{
	require(count < SL_MAX_CODELETS && c->nbuffers <= SL_MAX_BUFFERS, c,
		"cannot be registered (too many codelets or buffers)");
	require(has_buffer(c, SL_MODE_KIND_MASK, SL_ACC) == (c->accumulate_at >= 0), c,
		"an SL_ACC buffer needs SL_CODELET_ACC (naming the accumulate field) and "
		"SL_CODELET_ACC an SL_ACC buffer");
	require(has_buffer(c, SL_REPEAT, SL_REPEAT) == (c->repeat_at >= 0), c,
		"SL_REPEAT buffers need SL_CODELET_REPEAT (naming the count field) and "
		"SL_CODELET_REPEAT an SL_REPEAT buffer");
	c->id = count;
	table[count++] = c;
}

const struct sl_codelet *sl_codelet_get(int codelet)
{
	return codelet >= 0 && codelet < count ? table[codelet] : NULL;
}

int sl_codelet_count(void) { return count; }

const char *sl_codelet_name(int codelet)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	return c ? c->name : "?";
}

const char *sl_codelet_args_type(int codelet)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	return c ? c->args_type : "?";
}

const char *sl_codelet_repeat_field(int codelet)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	return c ? c->repeat_field : "";
}

int sl_codelet_sequential(int codelet)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	return c ? (c->flags & SL_SEQUENTIAL) != 0 : -1;
}

int32_t sl_mode_access(int mode, int redux, int accumulate)
{
	switch (SL_MODE_KIND(mode)) {
	case SL_R:
		return SL_ACCESS_R;
	case SL_W:
		return SL_ACCESS_W;
	case SL_GRAD:
		return redux ? SL_ACCESS_REDUX : SL_ACCESS_R | SL_ACCESS_W;
	case SL_ACC:
		return accumulate ? SL_ACCESS_R | SL_ACCESS_W : SL_ACCESS_W;
	default:
		return SL_ACCESS_R | SL_ACCESS_W;
	}
}

int sl_codelet_accumulate(const struct sl_codelet *c, const void *args)
{
	int accumulate = 0;
	if (c->accumulate_at >= 0 && args)
		memcpy(&accumulate, (const char *)args + c->accumulate_at, sizeof accumulate);
	return accumulate;
}

int sl_codelet_repeats(const struct sl_codelet *c, const void *args)
{
	if (c->repeat_at < 0)
		return 1;
	int k = 0; /* no arguments: no count, refused by sl_codelet_check_count */
	if (args)
		memcpy(&k, (const char *)args + c->repeat_at, sizeof k);
	return k;
}

/* the places declared buffer j takes in a task of repeat count k */
static int places(const struct sl_codelet *c, int j, int k)
{
	return (c->modes[j] & SL_REPEAT) ? k : 1;
}

int sl_codelet_declared(const struct sl_codelet *c, int k, int i)
{
	for (int j = 0, pos = 0; j < c->nbuffers; pos += places(c, j, k), j++)
		if (i < pos + places(c, j, k))
			return j;
	return -1;
}

int sl_codelet_check_count(const struct sl_codelet *c, int n, int k)
{
	if (k < 1 || n < 0)
		return -EINVAL;
	int total = 0;
	for (int j = 0; j < c->nbuffers; j++)
		total += places(c, j, k);
	if (n == total)
		return 0;
	for (int j = c->nbuffers - 1; j >= 0 && (c->modes[j] & SL_OPT); j--) {
		total -= places(c, j, k);
		if (n == total)
			return 0;
	}
	return -EINVAL;
}

int sl_codelet_modes(int codelet, int redux, int accumulate, int32_t *modes, int max)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	if (!c)
		return -EINVAL;
	for (int i = 0; i < c->nbuffers && i < max; i++) {
		int m = c->modes[i];
		modes[i] = sl_mode_access(m, redux, accumulate) |
			   ((m & SL_OPT) ? SL_ACCESS_OPTIONAL : 0) |
			   ((m & SL_REPEAT) ? SL_ACCESS_REPEAT : 0) | ((m & SL_ANY) ? SL_ACCESS_ANY : 0);
	}
	return c->nbuffers;
}

/* the flop expressions read the buffer count and sizes, never the memory */
double sl_codelet_flops(int codelet, const size_t *count_, int n, const void *args)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	if (!c || n < 0)
		return 0.0;
	struct sl_buf b[n > 0 ? n : 1];
	memset(b, 0, sizeof b);
	for (int i = 0; i < n; i++)
		b[i] = (struct sl_buf){ .ptr = NULL, .n = count_[i] };
	return c->flops(b, n, args);
}

int sl_codelet_run(int codelet, void *const *ptr, const size_t *count_, const size_t *elemsize,
		   int n, const void *args)
{
	const struct sl_codelet *c = sl_codelet_get(codelet);
	if (!c || sl_codelet_check_count(c, n, sl_codelet_repeats(c, args)) != 0)
		return -EINVAL;
	struct sl_buf *b = calloc((size_t)(n ? n : 1), sizeof *b);
	if (!b)
		return -ENOMEM;
	for (int i = 0; i < n; i++)
		b[i] = (struct sl_buf){ ptr[i], count_[i], elemsize[i] };
	c->run(b, n, args);
	free(b);
	return 0;
}
