/* tools/repro/lws-self-steal.sh's program. It forces the state of StarPU 1.4.12's lws race
 * (tools/patches/starpu-1.4.12-ws-no-self-steal.patch) with gdb's help (lws-self-steal.gdb):
 * worker 0 finds its queue's tasks not executable in its local pick (deny0); then gdb, at its
 * lws_select_victim, marks it busy (what a concurrent push_task_notify does), sets the
 * process-wide parallel-blocks flag (what an earlier parallel worker does) and lifts deny0.
 * Unpatched, worker 0 steals from itself and locks its own sched_mutex twice. */
#include <starpu.h>
#include <stdio.h>
volatile int deny0 = 1;
static void work(void *buffers[], void *arg) { (void)buffers; (void)arg; }
static int can_exec(unsigned workerid, struct starpu_task *task, unsigned nimpl)
{
	(void)task; (void)nimpl;
	/* pushes (from the main thread) see every worker able; worker 0's own pops not, until gdb says */
	return starpu_worker_get_id() == -1 || workerid != 0 || !deny0;
}
static struct starpu_codelet cl = { .cpu_funcs = { work }, .nbuffers = 0, .can_execute = can_exec };
int main(void)
{
	int ret = starpu_init(NULL);
	if (ret) { fprintf(stderr, "starpu_init: %d\n", ret); return 1; }
	for (int i = 0; i < 64; i++) {
		struct starpu_task *t = starpu_task_create();
		t->cl = &cl;
		ret = starpu_task_submit(t);
		if (ret) { fprintf(stderr, "submit: %d\n", ret); return 1; }
	}
	starpu_task_wait_for_all();
	starpu_shutdown();
	printf("all tasks done\n");
	return 0;
}
