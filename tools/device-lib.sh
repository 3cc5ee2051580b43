# The device scripts' time caps (sourced by tools/device-gpu.sh and tools/device-eval16.sh).
#
# `capped SECONDS COMMAND...` gives COMMAND $MARK_VAR=$mark (default: the sourcing script's
# pid) in its environment and runs it under timeout (TERM to its process group at the cap,
# KILL 10 s later; said when it comes), then ends whatever it left (sweep). The mark finds
# what the group does not: a child that ignored the TERM, or one in a group or session of its
# own (mpirun's ranks, gpu_bench's runs, a setsid) still holding the GPU or the cores. Status:
# COMMAND's (124 or 137 at the cap). With $dry set, capped echoes `timeout SECONDS COMMAND...`.
#
# The sourcing script defines say (one line of its log). A program can sweep too:
#   bash tools/device-lib.sh sweep MARK      (experiments/figures.py --after-each-run)
MARK_VAR=SL_DEVICE_RUN

capped() {
  [ -z "${dry:-}" ] || { echo timeout "$@"; return 0; }
  local m=${mark:-$$} rc
  env "$MARK_VAR=$m" timeout --kill-after=10 "$@"
  rc=$?
  [ "$(ended $rc)" = "exit $rc" ] || say "capped at $1 s: $(cut -c1-200 <<<"${*:2}")"
  sweep "$m"
  return $rc
}
# how a capped command ended, for a message: "exit N", or "cut at its cap" (timeout's statuses)
ended() { case $1 in 124 | 137) echo "cut at its cap" ;; *) echo "exit $1" ;; esac; }
# the live processes marked $1 (a zombie's environment reads empty): pid and command line
marked() {
  local f
  for f in $(grep -lzx "$MARK_VAR=$1" /proc/[0-9]*/environ 2>/dev/null); do
    f=${f%/environ}
    echo "${f#/proc/} $(tr '\0' ' ' <"$f/cmdline" 2>/dev/null | cut -c1-100)"
  done
}
# TERM to each process marked $1, KILL to those left 10 s later; 1 if one outlives the KILL by
# 30 s (a process stuck in the driver)
sweep() {
  local sig left n wait=10
  for sig in TERM KILL; do
    left=$(marked "$1")
    [ -n "$left" ] || return 0
    say "$sig to what outlived its command: ${left//$'\n'/; }"
    kill -s "$sig" $(cut -d' ' -f1 <<<"$left") 2>/dev/null
    [ "$sig" = TERM ] || wait=30
    for ((n = 0; n < wait; n++)); do
      sleep 1
      [ -n "$(marked "$1")" ] || return 0
    done
  done
  left=$(marked "$1")
  say "still alive after KILL: ${left//$'\n'/; }"
  return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  say() { echo "[device-lib] $*"; }
  [ "${1:-}" = sweep ] && [ $# -eq 2 ] || { echo "usage: $0 sweep MARK" >&2; exit 2; }
  sweep "$2"
fi
