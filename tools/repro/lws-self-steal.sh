#!/usr/bin/env bash
# StarPU 1.4.12's lws deadlock after parallel workers (tools/patches/starpu-1.4.12-ws-no-self-steal.patch),
# made to happen every time: lws-self-steal.c submits 64 empty tasks to 2 CPU workers under lws,
# and gdb (lws-self-steal.gdb), when worker 0 looks for a victim after its local pick found its
# queue's tasks not executable (the codelet's can_execute, once), sets what the race sets: worker
# 0 busy (a concurrent push_task_notify) and the process-wide parallel-blocks flag (an earlier
# parallel worker). Unpatched, worker 0 steals from itself and waits on its own sched_mutex in
# starpu_worker_is_blocked_in_parallel (the backtrace of make test-1.4's hang); patched, every
# task runs. Needs gdb and a StarPU 1.4.12 with debug information (StarPU's default flags keep
# -g: make test-1.4's build has it):
#
#   tools/repro/lws-self-steal.sh .deps/starpu-1.4       # "completed" or "HUNG", exit 0 or 1
#
# An unpatched build to compare: tools/build-starpu.sh from a copy of tools/ whose patches/
# lacks starpu-1.4.12-ws-no-self-steal.patch. Not a test: it needs gdb, and it forces the race's
# state from outside, so it shows what the patch changes in that state, not how often the
# state comes.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: $0 STARPU_PREFIX" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(realpath "$1")
command -v gdb >/dev/null || { echo "$0: needs gdb" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
gcc -g -O0 "$here/lws-self-steal.c" -o "$work/repro" $(pkg-config --cflags --libs starpu-1.4) \
    -Wl,-rpath,"$prefix/lib" || { echo "$0: could not build against $prefix" >&2; exit 2; }
STARPU_SCHED=lws STARPU_NCPU=2 STARPU_SILENT=1 timeout -s INT 15 \
    gdb -q -batch -x "$here/lws-self-steal.gdb" "$work/repro" >"$work/gdb.txt" 2>&1
grep -q "^forced:" "$work/gdb.txt" || { cat "$work/gdb.txt"; echo "$0: the state was not forced (no debug information?)" >&2; exit 2; }
if grep -q "all tasks done" "$work/gdb.txt"; then
  echo "$prefix: completed (every task ran with the state forced)"
  exit 0
fi
grep -E "starpu_worker_is_blocked_in_parallel|ws_pop_task|lll_lock_wait" "$work/gdb.txt" | head -5
echo "$prefix: HUNG after 15 s with the state forced"
exit 1
