# The device scripts' time caps (sourced by tools/device-gpu.sh and tools/device-eval16.sh).
#
# `capped SECONDS COMMAND...` gives COMMAND $MARK_VAR=$mark (default: the sourcing script's
# pid) in its environment and runs it under timeout (TERM to its process group at the cap,
# KILL kill_after s later), then ends whatever it left (sweep). The mark finds what the group
# does not: a child that ignored the TERM, or one in a group or session of its own (mpirun's
# ranks, gpu_bench's runs, a setsid) still holding the GPU or the cores. Status: COMMAND's
# (124 or 137 at the cap). How it ended, in capped_how and said when not a plain exit:
# "capped after N s" (its cap), or "killed by SIGxxx after N s, before its cap" (a signal
# capped did not send: for SIGKILL most likely the kernel's OOM killer, which dmesg names).
# It ends within SECONDS + kill_after + sweep's longest (sweep_term_s + sweep_kill_s).
# With $dry set, capped echoes `timeout SECONDS COMMAND...`.
#
# The sourcing script defines say (one line of its log). A program can sweep too:
#   bash tools/device-lib.sh sweep MARK...   (experiments/figures.py --after-each-run)
MARK_VAR=SL_DEVICE_RUN
# from the cap's TERM to its KILL; sweep's waits after its TERM, and after its KILL (each
# may be given, e.g. `sweep_term_s=3 sweep_kill_s=5 bash tools/device-lib.sh sweep MARK`)
: "${kill_after:=10}" "${sweep_term_s:=10}" "${sweep_kill_s:=30}"

capped() {
  [ -z "${dry:-}" ] || { echo timeout "$@"; capped_how="exit 0"; return 0; }
  local m=${mark:-$$} rc t0 ms
  t0=$(date +%s%N)
  env "$MARK_VAR=$m" timeout --kill-after="$kill_after" "$@"
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  capped_how=$(how_ended "$rc" "$1" "$ms")
  [ "$capped_how" = "exit $rc" ] || say "$capped_how: $(cut -c1-200 <<<"${*:2}")"
  sweep "$m"
  return $rc
}
# how a command capped at $2 s ended, with status $1 after $3 ms: at its cap (timeout's 124,
# or 128 + the signal that ended it after the cap), by a signal before it, or "exit N"
how_ended() {
  local rc=$1 cap_ms=$(( ${2%%[!0-9]*} * 1000 )) s=$(( $3 / 1000 )) sig
  if [ "$rc" -eq 124 ] && [ "$3" -ge "$cap_ms" ]; then echo "capped after $s s"
  elif [ "$rc" -gt 128 ] && [ "$rc" -le 192 ]; then
    sig=$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))
    if [ "$3" -ge "$cap_ms" ]; then
      echo "capped after $s s (SIG$sig: it outlived the cap's TERM)"
    else
      echo "killed by SIG$sig after $s s, before its cap (${2%%[!0-9]*} s)$(sig_source "$sig")"
    fi
  else echo "exit $rc"; fi
}
# who likely sent a SIGKILL no cap sent: the OOM killer, by dmesg's last line of one
sig_source() {
  [ "$1" = KILL ] || return 0
  local k
  if ! k=$(dmesg 2>/dev/null); then echo ": likely the OOM killer (dmesg unreadable here)"
  elif k=$(grep -iE "out of memory|oom-kill|killed process" <<<"$k" | tail -n1) && [ -n "$k" ]; then
    echo ": dmesg's last OOM kill: $k"
  else echo ": not the OOM killer by dmesg (no OOM kill there)"; fi
}
# the live processes marked with one of $@ (a zombie's environment reads empty): pid and
# command line
marked() {
  local f m pats=()
  for m in "$@"; do pats+=(-e "$MARK_VAR=$m"); done
  for f in $(grep -lzx "${pats[@]}" /proc/[0-9]*/environ 2>/dev/null); do
    f=${f%/environ}
    echo "${f#/proc/} $(tr '\0' ' ' <"$f/cmdline" 2>/dev/null | cut -c1-100)"
  done
}
# TERM to each process marked with one of $@, KILL to those left sweep_term_s later; 1 if one
# outlives the KILL by sweep_kill_s (a process stuck in the driver)
sweep() {
  local sig left n wait=$sweep_term_s
  for sig in TERM KILL; do
    left=$(marked "$@")
    [ -n "$left" ] || return 0
    say "$sig to what outlived its command: ${left//$'\n'/; }"
    kill -s "$sig" $(cut -d' ' -f1 <<<"$left") 2>/dev/null
    [ "$sig" = TERM ] || wait=$sweep_kill_s
    for ((n = 0; n < wait; n++)); do
      sleep 1
      [ -n "$(marked "$@")" ] || return 0
    done
  done
  left=$(marked "$@")
  say "still alive after KILL: ${left//$'\n'/; }"
  return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  say() { echo "[device-lib] $*"; }
  [ "${1:-}" = sweep ] && [ $# -ge 2 ] || { echo "usage: $0 sweep MARK..." >&2; exit 2; }
  sweep "${@:2}"
fi
