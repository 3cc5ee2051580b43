#!/bin/bash
# Interleaved A/B: ab2da23 (the fifth session's start, built in a `git worktree` at $OLD with its
# own .venv) against HEAD ($NEW), each command run by both builds in turn, ROUNDS times; every
# run's output is appended to $OUT/NAME-{old,new}.log (the per-step lines and the final tok/ms).
#   git worktree add /tmp/base ab2da23 && (cd /tmp/base && python3 -m venv .venv && ... make install's pip lines)
#   OLD=/tmp/base NEW=$PWD ROUNDS=6 experiments/results/timing/fifth-session-ab/run.sh
OLD=${OLD:?the ab2da23 worktree} NEW=${NEW:-$PWD} OUT=${OUT:-/tmp/ab} ROUNDS=${ROUNDS:-5}
mkdir -p "$OUT"
run() {  # NAME ARGS...: ROUNDS rounds, new first in odd ones and old first in even ones (a
  name=$1; shift   # machine whose load drifts during the call then favours neither build)
  for round in $(seq "$ROUNDS"); do
    order="new old"; [ $((round % 2)) = 0 ] && order="old new"
    for build in $order; do
      dir=$NEW; [ $build = old ] && dir=$OLD
      (cd "$dir" && .venv/bin/starpu-llm train "$@" >>"$OUT/$name-$build.log" 2>&1)
    done
  done
}
run t64 --model d12 --batch 4 --seq-len 64 --steps 6
run ref --model d12 --batch 4 --seq-len 64 --steps 6 --engine reference
run t1024 --model d12 --batch 1 --seq-len 1024 --steps 4
