#!/usr/bin/env bash
# The paper's evaluation on a borrowed 16-core node (issues 34, 42): one script, one call of the
# device tool. docs/figures.md, "Figures on a node lent for minutes", gives the exact call.
#
#   tools/device-eval16.sh --prepare   # here (network, git): fill .device-eval/ (ignored) with
#                                      # what the bare node lacks; nothing there is committed
#   tools/device-eval16.sh --device    # there: build, calibrate, predict, measure -> $OUT
#   tools/device-eval16.sh --small --python PY312   # here: the --device stages end to end at
#                                      # 2 cores on the tiny model (PY312: a Python 3.12 with
#                                      # numpy, mpi4py, meson and ninja, as the node's)
#
# --prepare needs a fetched llm.c (the search tools' `fetch github:karpathy/llm.c`; LLMC_REPO,
# default /work/.mirror/karpathy+llm.c/repo, at commit f1e2ace), ../shared/vendor's StarPU
# 1.4.12, apt-get and pip. It writes .device-eval/:
#   whl/        cp312 manylinux wheels the node's Python lacks, tools/device-wheels.txt's (the
#               build's and the data packages)
#   starpu-1.4.12-autogen.tar.gz   the vendored StarPU after ./autogen.sh (no libtool there),
#                                  tools/patches/ applied (build-starpu.sh --autogen)
#   starpu-1.4.12-prefix.tar.gz    that StarPU built here with the node's options, installed in
#               /tmp/eval16-starpu (the node unpacks it there; it builds its own from the tree
#               above instead when a library it links is missing there)
#   deb/        Debian's OpenMP OpenBLAS (libopenblas0-openmp) and libgfortran5, unpacked there
#               with dpkg -x into the work folder (never into /)
#   llmc/       llm.c's train_gpt2.c and llmc/*.h at f1e2ace, and its LICENSE (experiments/llmc.py
#               patches and builds them there)
#   cache/      the bundled Shakespeare tokenized (STARPU_LLM_CACHE), so no run tokenizes
#   commit.txt  the commit of this tree (the node's copy has no .git)
#
# --device (and --small) stages, with their expected time on the 16-core node:
#   1. StarPU 1.4.12 CPU + MPI + parallel workers, --enable-maxcpus=64: tools/device-gpu.sh's
#      build when the GPU run of the same device session left it (${SL_DEVICE_WORK:-/tmp/sl-gpu}/
#      starpu; its CUDA workers stay off), else the carried build unpacked (~1 s), else built
#      (~40 s); beside it OpenBLAS's OpenMP build unpacked (library and cblas.h), llm.c patched
#      and built against it, llm.c's checkpoint and data (~10 s)
#   2. starpu-llm built with the carried wheels into a --target folder (~15 s; a second call on
#      the same warm machine reuses its build folder), linked to that OpenBLAS by meson
#      (-Dopenblas_dir, -Dopenblas_include, -Dopenblas_required: no silent fallback); checks:
#      ldd shows that libopenblas, blas_name says openmp, and experiments/blas_preflight.py
#      (~20 s) times a k-core task's GEMM on 4x4 and 1x16 against one core's; if any check
#      fails, the k > 1 points are not run and 00-status.txt says why. A 2-rank mpirun smoke run
#   3. the calibration held out by configuration (~60 s): calibrate --quick's traced runs on
#      EVAL_CAL_PARTITIONS only (1x16,4x4,16x1 at 1 and 6 sequences per worker), no mpirun
#      link fit (the link stays the ping-pong's: no Figure 4 point is fitted)
#   4. experiments/figures.py: every point predicted (~15 s; those equal to a calibration run
#      marked in-sample), the plan by priority (Figure 3 at its first batch and the largest of
#      the others that fits, Figure 2b, 2a, llm.c and StarPU 1x16, 16x1 at EVAL_LLMC_BATCHES,
#      Figure 4),
#      each point EVAL_WARMUP warm-up and at least EVAL_MIN_STEPS timed steps (their median
#      kept), cut so that it ends EVAL_MARGIN s before the deadline: a point that does not
#      fit is dropped (named in the log, lowest priority first, and in runs.csv), the shorter
#      ones after it still tried; points an earlier call measured (this warm
#      machine's, or EVAL_RESUME's runs.csv files) are not run again
#   5. $OUT: 00-status.txt (first: the machine -- CPU, cores, the device machine's kind from
#      nvidia-smi, StarPU, BLAS -- and every failure), runs.csv, predictions.csv,
#      autotune_rank.csv, points.json, calibration.toml, log.txt and eval16.tar.gz (the work
#      folder: env.txt, build, preflight and calibration logs); copied every 10 s, so a killed
#      run still brings back what it measured. experiments/eval16_report.py turns them into
#      the committed results.
#   Each command is capped (tools/device-lib.sh: at the cap all it started ends, a child that
#      ignores TERM or left its process group -- mpirun's ranks -- too, found by a mark in its
#      environment) within the deadline, and every timed run of figures.py's is swept the same
#      way before the next starts: nothing a run left takes cores from the runs after it.
#      A watchdog ends the stages PACK_S s before the end whatever they do (times(): the run
#      ends by EVAL_DEADLINE_AT and within the device's 600 s, a build not reused and every
#      point at its cap included). Every command's error messages go to log.txt.
#   tools/device-eval16.sh --dry-run   # here: the plan for the node and its cut, predicted from
#                                      # the reference calibration (EVAL_* settings apply)
#
# Settings (environment; the defaults are the node's): EVAL_SECONDS (590: the end after the
# start) or EVAL_DEADLINE_AT (epoch seconds: e.g. what the device session has left after the
# GPU run), either way at most the start + 590, EVAL_MARGIN (30), EVAL_MODEL (d12), EVAL_CORE_COUNTS (1,2,4,8,16), EVAL_WEAK
# (sequences per core, 1), EVAL_STRONG (16), EVAL_FIG3 (16,160,96,64,32: the first, then the
# largest that fits), EVAL_LLMC_BATCHES (32,64), EVAL_RANKS (1,2,4), EVAL_RESERVE (1),
# EVAL_MPI_BATCH (per rank, 8), EVAL_WARMUP (2), EVAL_MIN_STEPS (3), EVAL_POINT_SECONDS (3),
# EVAL_MAX_STEPS (10), EVAL_ONLY (fig3,fig2b,fig2a,fig2-llmc,fig4: also the priority),
# EVAL_CAL_PARTITIONS (1x16,4x4,16x1), EVAL_PREFLIGHT (4x4,1x16), EVAL_RESUME (runs.csv files),
# EVAL_NODE_CORES (16: more CPUs are cut to the first 16), EVAL_WORK (/tmp/eval16),
# EVAL_STARPU_PREFIX (an existing StarPU 1.4 build), EVAL_CAL_SECONDS (150),
# EVAL_SETUP_SECONDS (--dry-run: 130), PYTHON (python3).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
E=$REPO/.device-eval
. "$REPO/tools/device-lib.sh"        # capped, sweep: each --device command's cap (the header)
LLMC_COMMIT=f1e2ace
# StarPU 1.4.12 as the node runs it: CPU, MPI, parallel workers, up to 64 CPU workers
STARPU_OPTIONS=(--enable-mpi --enable-parallel-worker --enable-maxcpus=64 --disable-cuda
  --disable-opencl --disable-hip --disable-fortran --disable-build-doc --disable-build-examples
  --disable-build-tests --disable-static --disable-starpufft --disable-socl --disable-fxt
  --disable-starpupy)
# where --prepare installs the StarPU it carries, and --device unpacks it: the same path, which
# its pkg-config files and libtool archives name
CARRIED_PREFIX=/tmp/eval16-starpu

die() { echo "device-eval16.sh: $*" >&2; exit 1; }

# ------------------------------------------------------------------------------ --prepare
prepare() {
  set -e
  local llmc_repo=${LLMC_REPO:-/work/.mirror/karpathy+llm.c/repo}
  local tarball=${STARPU_TARBALL:-$REPO/../shared/vendor/starpu-1.4.12.tar.gz}
  [ -f "$tarball" ] || die "no StarPU tarball at $tarball (STARPU_TARBALL=...)"
  git --git-dir="$llmc_repo" cat-file -e "$LLMC_COMMIT:train_gpt2.c" 2>/dev/null ||
    git -C "$llmc_repo" cat-file -e "$LLMC_COMMIT:train_gpt2.c" 2>/dev/null ||
    die "no llm.c at $LLMC_COMMIT in $llmc_repo: fetch github:karpathy/llm.c first (LLMC_REPO=...)"
  git -C "$REPO" check-ignore -q .device-eval/x || die ".device-eval/ is not ignored by git"
  mkdir -p "$E/whl" "$E/deb" "$E/llmc/llmc" "$E/cache"

  echo "== wheels (cp312 manylinux) -> $E/whl"
  rm -f "$E"/whl/*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$E/whl" -r "$REPO/tools/device-wheels.txt"

  # after autogen.sh, with tools/patches/'s fixes (the lws deadlock after parallel workers,
  # which Figure 3's K > 1 points run on): remade by build-starpu.sh when a fix changes
  echo "== StarPU 1.4.12 after autogen.sh, fixed -> $E/starpu-1.4.12-autogen.tar.gz"
  "$REPO/tools/install-system-deps.sh" autoconf automake libtool-bin make patch
  "$REPO/tools/build-starpu.sh" --autogen "$tarball" "$E/starpu-1.4.12-autogen.tar.gz"

  echo "== StarPU 1.4.12 built here for the node -> $E/starpu-1.4.12-prefix.tar.gz"
  if [ ! "$E/starpu-1.4.12-prefix.tar.gz" -nt "$E/starpu-1.4.12-autogen.tar.gz" ]; then
    "$REPO/tools/install-system-deps.sh" libhwloc-dev libopenmpi-dev openmpi-bin pkg-config gcc
    local b; b=$(mktemp -d)
    rm -rf "$CARRIED_PREFIX"
    tar -xzf "$E/starpu-1.4.12-autogen.tar.gz" -C "$b"
    mkdir -p "$b/starpu-1.4.12/build"
    (cd "$b/starpu-1.4.12/build" && ../configure --prefix="$CARRIED_PREFIX" "${STARPU_OPTIONS[@]}" \
       >"$b/configure.log" 2>&1 && make -j"$(nproc)" >"$b/make.log" 2>&1 &&
     make install >>"$b/make.log" 2>&1) || { tail -n 30 "$b"/*.log; exit 1; }
    tar -czf "$E/starpu-1.4.12-prefix.tar.gz" -C "$(dirname "$CARRIED_PREFIX")" \
      "$(basename "$CARRIED_PREFIX")"
    rm -rf "$b" "$CARRIED_PREFIX"
  fi

  echo "== Debian's OpenMP OpenBLAS (library and cblas.h) and libgfortran5 -> $E/deb"
  rm -f "$E"/deb/*.deb
  (cd "$E/deb" && apt-get download libopenblas0-openmp libopenblas-openmp-dev libgfortran5 \
     >/dev/null)

  echo "== llm.c $LLMC_COMMIT (train_gpt2.c, llmc/*.h, LICENSE) -> $E/llmc"
  local g=(git --git-dir="$llmc_repo")
  "${g[@]}" cat-file -e "$LLMC_COMMIT:train_gpt2.c" 2>/dev/null || g=(git -C "$llmc_repo")
  "${g[@]}" show "$LLMC_COMMIT:train_gpt2.c" >"$E/llmc/train_gpt2.c"
  "${g[@]}" show "$LLMC_COMMIT:LICENSE" >"$E/llmc/LICENSE"
  for h in $("${g[@]}" ls-tree --name-only "$LLMC_COMMIT" llmc/ | grep '\.h$'); do
    "${g[@]}" show "$LLMC_COMMIT:$h" >"$E/llmc/$h"
  done

  echo "== the Shakespeare shards -> $E/cache"
  local py=$REPO/.venv/bin/python
  [ -x "$py" ] || py=python3
  STARPU_LLM_CACHE=$E/cache PYTHONPATH=$REPO "$py" -c \
    'from starpu_llm.io.data import default_dataset; print(*default_dataset())'

  git -C "$REPO" describe --always --dirty --abbrev=10 >"$E/commit.txt"
  case "$(cat "$E/commit.txt")" in
    *-dirty) echo "WARNING: the tree has uncommitted changes; commit, then --prepare again" \
                  "(the runs name $(cat "$E/commit.txt"))" ;;
  esac
  (cd "$E" && find . -type f ! -name MANIFEST | sort | xargs sha256sum >MANIFEST)
  local carried tree
  carried=$(du -sb "$E" | cut -f1)
  tree=$(git -C "$REPO" ls-files -z --cached --others --exclude-standard | (cd "$REPO" &&
         xargs -0 du -cb 2>/dev/null) | tail -n1 | cut -f1)
  echo "== ready: .device-eval $((carried >> 20)) MiB + the tree $((tree >> 20)) MiB" \
       "(the device tool carries 64 MiB); commit $(cat "$E/commit.txt")"
  [ $((carried + tree)) -lt $((60 << 20)) ] || die "over 60 MiB: the device tool would refuse it"
}

# ------------------------------------------------------------------------------ --device
START=$(date +%s)
W=${EVAL_WORK:-/tmp/eval16}
# the marks of what --device starts (capped's default, $$: its commands): the two builds in
# the background, figures.py's timed runs, and the stages' other commands (body)
MARK_STARPU=$$-starpu MARK_LLMC=$$-llmc MARK_RUNS=$$-runs MARK_BODY=$$-body
stamp() { echo "$(date +%T) [$(( $(date +%s) - START )) s] $*"; }
log() { stamp "$*" | tee -a "$W/log.txt"; }
# device-lib.sh's messages: in log.txt, whatever the capped command's output is sent to
say() { stamp "$*" >>"$W/log.txt"; }
# 00-status.txt: the first file back (alphabetical) says what failed and why, and the machine
status() { echo "$*" >>"$W/00-status.txt"; log "$*"; cp -f "$W/00-status.txt" "$OUT/"; }

# the files that come back ($OUT: at most 8); run every 10 s and at the end
sync_out() {
  for f in 00-status.txt fig/runs.csv fig/predictions.csv fig/autotune_rank.csv fig/points.json \
           calibration.toml log.txt; do
    [ -f "$W/$f" ] && cp -f "$W/$f" "$OUT/$(basename "$f")"
  done
  return 0
}

pack() {
  [ -n "${SYNC_PID:-}" ] && kill "$SYNC_PID" 2>/dev/null      # (ended already: nothing to do)
  # what the stages left running (cut by the watchdog, or an early exit): a background build,
  # figures.py's run at its cap; within PACK_S (the waits below)
  sweep_term_s=3 sweep_kill_s=5 sweep "$MARK_BODY" "$MARK_STARPU" "$MARK_LLMC" "$MARK_RUNS" "$$"
  log "packing $OUT"
  # log.txt apart (it comes back itself; tar's own messages go to it)
  timeout -k 2 10 tar -czf "$OUT/eval16.tar.gz.tmp" -C "$W" --exclude='build-*' --exclude=site \
    --exclude='starpu-1.4.12' --exclude=starpu --exclude='llmc/*.bin' --exclude=cache \
    --exclude=ob --exclude=gf --exclude='llmc/train_gpt2' --exclude=previous \
    --exclude=./log.txt . && mv "$OUT/eval16.tar.gz.tmp" "$OUT/eval16.tar.gz" ||
    log "eval16.tar.gz not written (tar's message above)"
  ls -la "$OUT" | tee -a "$W/log.txt"
  sync_out
}

# the settings of the plan, the same for the device run and --dry-run (figures.py's options)
plan_args() {
  echo --model "${EVAL_MODEL:-d12}" --only "${EVAL_ONLY:-fig3,fig2b,fig2a,fig2-llmc,fig4}" \
    --order priority --cores "${EVAL_CORE_COUNTS:-1,2,4,8,16}" \
    --weak-per-core "${EVAL_WEAK:-1}" --strong-batch "${EVAL_STRONG:-16}" \
    --fig3-batches "${EVAL_FIG3:-16,160,96,64,32}" --fig3-kcore team \
    --llmc-batches "${EVAL_LLMC_BATCHES:-32,64}" --ranks "${EVAL_RANKS:-1,2,4}" \
    --mpi-split --mpi-reserve "${EVAL_RESERVE:-1}" --mpi-batch-per-rank "${EVAL_MPI_BATCH:-8}" \
    --warmup "${EVAL_WARMUP:-2}" --min-steps "${EVAL_MIN_STEPS:-3}" \
    --steps "${EVAL_MAX_STEPS:-10}" --point-seconds "${EVAL_POINT_SECONDS:-3}" \
    --margin "${EVAL_MARGIN:-30}" --calibration-runs "$(cal_parts):1,6" --repeat 1
}
# the calibration's traced runs, held out by configuration: these partitions at 1 and 6
# sequences per worker (calibrate --quick's); every other point is a prediction
cal_parts() { echo "${EVAL_CAL_PARTITIONS:-1x16,4x4,16x1}"; }

# The times of a --device run, each fact once (epoch seconds):
#   END      everything in $OUT and the script ended: EVAL_DEADLINE_AT (e.g. what the device
#            session leaves after the GPU run), else the start + EVAL_SECONDS, and never later
#            than the device tool's 600 s per command less 10 (bash's start, the exit)
#   T_PACK   END - PACK_S: the watchdog ends whatever stage still runs, and pack starts
#   RUNS_AT  figures.py's deadline, T_PACK - FIG_WRITE_S (its files written after its last
#            run); each of its runs is capped at the time left less its tail: END_GRACE from
#            TERM to KILL, then the after-run sweep's RUN_SWEEP_S
# So the stages end by T_PACK whatever they do (at worst the watchdog's TERM, then KILL 3 s
# later), and pack takes at most PACK_S: its sweep (waits 3 + 5 s), tar (10 s, KILL 2 s
# later), the copies. figures.py --dry-run shows its runs' worst case (every run killed at
# its cap) ending before RUNS_AT.
DEVICE_LIMIT_S=600 PACK_S=30 FIG_WRITE_S=10
RUN_SWEEP_WAITS="sweep_term_s=4 sweep_kill_s=4" RUN_SWEEP_S=10   # its waits, and its longest
times() {
  END=${EVAL_DEADLINE_AT:-$((START + ${EVAL_SECONDS:-590}))}
  local hard=$((START + DEVICE_LIMIT_S - 10))
  [ "$END" -le "$hard" ] || END=$hard
  T_PACK=$((END - PACK_S)) RUNS_AT=$((END - PACK_S - FIG_WRITE_S))
}

dry_run() {
  # the plan on the 16-core node, here: predicted from the bundled reference calibration and
  # experiments/machines/device-node-16.toml (assumed rates), its cut at the deadline shown,
  # less what the node spends before its first run (EVAL_SETUP_SECONDS: build ~25 s, BLAS
  # preflight ~20 s, mpirun smoke run ~10 s, calibration ~60 s, predictions ~15 s)
  local py=${PYTHON:-$REPO/.venv/bin/python}
  local setup=${EVAL_SETUP_SECONDS:-130}
  times
  local deadline=$((RUNS_AT - setup))
  echo "dry run: the end +$((END - START)) s, pack from +$((T_PACK - START)) s, the runs'" \
       "deadline +$((RUNS_AT - START)) s, less the node's set-up counted as $setup s:" \
       "$(date -d "@$deadline" +%T)"
  mkdir -p /tmp/eval16-dry
  # shellcheck disable=SC2046  # (plan_args: words on purpose)
  cd "$REPO/experiments" && $py figures.py --dry-run --node-cores "${EVAL_NODE_CORES:-16}" \
    --machine "$REPO/experiments/machines/device-node-16.toml" \
    --calibration "$REPO/starpu_llm/perf/reference-calibration.toml" $(plan_args) \
    --series tensor,data,llmc --deadline-at "$deadline" --allow-dirty --no-plots \
    --after-each-run-seconds "$RUN_SWEEP_S" \
    --no-sgemm-peak --out /tmp/eval16-dry $(for f in ${EVAL_RESUME:-}; do echo --resume "$f"; done)
}

device_kind() {
  # the H100 and H200 machines' CPUs report the same name: the kind from the GPU's
  local gpu; gpu=$(capped 30 nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
  case "$gpu" in
    *H200*) echo nvidia-h200 ;; *H100*) echo nvidia-h100 ;;
    "") echo no-gpu ;; *) echo "gpu-$(echo "$gpu" | tr -cs 'A-Za-z0-9' - | tr A-Z a-z)" ;;
  esac
}

device() {
  [ -n "${OUT:-}" ] || die "--device writes into \$OUT (the device tool sets it)"
  [ -f "$E/commit.txt" ] || die "no $E: run tools/device-eval16.sh --prepare here first"
  # an earlier call on this warm machine: its build is reused, its runs resumed from
  mkdir -p "$W" "$OUT"
  if [ -f "$W/fig/runs.csv" ]; then
    mkdir -p "$W/previous" && cp "$W/fig/runs.csv" "$W/previous/runs-$(date +%s).csv"
  fi
  rm -rf "$W/fig" "$W/log.txt" "$W/00-status.txt" "$W/calibration.toml"
  # every command's error messages in log.txt, which comes back (none discarded)
  exec 2>>"$W/log.txt"
  PY=${PYTHON:-python3}
  times
  # every 10 s; its sleep ends with it (pack's kill), so nothing of it outlives the run
  (trap 'kill $! 2>/dev/null; exit' TERM; while :; do sleep 10 & wait $!; sync_out; done) &
  SYNC_PID=$!
  # the stages in a subshell, their commands marked MARK_BODY; the watchdog below ends them
  # at T_PACK whatever they do, then pack (the EXIT trap)
  ( trap - EXIT; export "$MARK_VAR=$MARK_BODY"; stages ) &
  local body=$! rc n
  trap pack EXIT
  while kill -0 "$body" 2>/dev/null && [ "$(date +%s)" -lt "$T_PACK" ]; do sleep 1; done
  if kill -0 "$body" 2>/dev/null; then
    status "CUT at +$((T_PACK - START)) s, $PACK_S s before the end: the stage running then" \
           "ended (log.txt's last lines); what was measured before comes back"
    kill -TERM "$body" 2>/dev/null
    for ((n = 0; n < 3; n++)); do sleep 1; kill -0 "$body" 2>/dev/null || break; done
    kill -KILL "$body" 2>/dev/null
  fi
  wait "$body"; rc=$?
  exit $rc
}

# the --device stages (a subshell of device's, ended at T_PACK)
stages() {
  local model=${EVAL_MODEL:-d12}
  # a command's cap: at most $1 s (default: no more), and what T_PACK leaves (at least 1: the
  # watchdog ends it there anyway)
  cap() { local l=$(( T_PACK - $(date +%s) )); l=$(( l > 1 ? l : 1 ));
          echo $(( ${1:-$l} < l ? ${1:-$l} : l )); }
  export STARPU_LLM_COMMIT; STARPU_LLM_COMMIT=$(cat "$E/commit.txt")
  export SL_DEVICE_KIND; SL_DEVICE_KIND=$(device_kind)
  local cpu; cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n1)
  status "eval16 on $(hostname): $cpu, $(nproc) CPUs, device machine $SL_DEVICE_KIND;" \
         "commit $STARPU_LLM_COMMIT; ends by $(date -d "@$END" +%T) (+$((END - START)) s;" \
         "runs until +$((RUNS_AT - START)) s); $($PY --version 2>&1)"

  # ---- 1. StarPU (the GPU run's if this machine has it, else the carried one, else built),
  # OpenBLAS's OpenMP build (runtime and headers, unpacked), llm.c
  local gpu_starpu=${SL_DEVICE_WORK:-/tmp/sl-gpu}/starpu       # tools/device-gpu.sh's prefix
  local prefix=${EVAL_STARPU_PREFIX:-$W/starpu} build_starpu=1
  if [ -n "${EVAL_STARPU_PREFIX:-}" ]; then build_starpu=0
  elif [ -f "$gpu_starpu/lib/pkgconfig/starpumpi-1.4.pc" ]; then
    prefix=$gpu_starpu build_starpu=0
    log "StarPU: the GPU run's build in $gpu_starpu (MPI, parallel workers; its CUDA workers unused)"
  elif [ -f "$W/starpu/lib/pkgconfig/starpumpi-1.4.pc" ]; then build_starpu=0
  elif [ -f "$E/starpu-1.4.12-prefix.tar.gz" ]; then
    rm -rf "$CARRIED_PREFIX" && tar -xzf "$E/starpu-1.4.12-prefix.tar.gz" -C "$(dirname "$CARRIED_PREFIX")"
    if ldd "$CARRIED_PREFIX"/lib/libstarpu*.so | grep -q "not found"; then
      log "the carried StarPU misses libraries here: $(ldd "$CARRIED_PREFIX"/lib/libstarpu*.so |
           grep "not found" | sort -u | tr -s ' \t\n' ' '); building it"
    else
      prefix=$CARRIED_PREFIX build_starpu=0
    fi
  fi
  if [ $build_starpu = 1 ]; then
    (
      mark=$MARK_STARPU      # its own mark: it runs beside the commands below
      rm -rf "$W/starpu-1.4.12" && tar -xzf "$E/starpu-1.4.12-autogen.tar.gz" -C "$W" &&
      mkdir -p "$W/starpu-1.4.12/build" && cd "$W/starpu-1.4.12/build" &&
      capped "$(cap)" ../configure --prefix="$prefix" "${STARPU_OPTIONS[@]}" \
        >"$W/starpu-configure.log" 2>&1 &&
      capped "$(cap)" make -j"$(nproc)" >"$W/starpu-make.log" 2>&1 &&
      capped "$(cap)" make install >>"$W/starpu-make.log" 2>&1
    ) & local starpu_pid=$!
  fi
  rm -rf "$W/ob" && mkdir -p "$W/ob"
  for deb in "$E"/deb/libopenblas0-openmp_*.deb "$E"/deb/libopenblas-openmp-dev_*.deb; do
    dpkg -x "$deb" "$W/ob" || status "FAILED: unpacking $(basename "$deb")"
  done
  local ob=$W/ob/usr/lib/x86_64-linux-gnu/openblas-openmp
  local ob_inc=$W/ob/usr/include/x86_64-linux-gnu/openblas-openmp
  if ldd "$ob/libopenblas.so.0" | grep -q "not found"; then
    mkdir -p "$W/gf" && dpkg -x "$E"/deb/libgfortran5_*.deb "$W/gf"
    export LD_LIBRARY_PATH=$W/gf/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    log "libgfortran5 missing here: Debian's is used"
  fi
  mkdir -p "$W/cache" && cp "$E"/cache/* "$W/cache/"
  export STARPU_LLM_CACHE=$W/cache
  (
    mark=$MARK_LLMC
    PYTHONPATH=$REPO capped "$(cap)" $PY "$REPO/experiments/llmc.py" build "$E/llmc" "$W/llmc" \
      --openblas "$ob" && PYTHONPATH=$REPO capped "$(cap)" $PY "$REPO/experiments/llmc.py" \
      checkpoint "$W/llmc" --model "$model"
  ) >"$W/llmc-build.log" 2>&1 & local llmc_pid=$!
  if [ $build_starpu = 1 ]; then
    wait "$starpu_pid" || { status "FAILED: StarPU's build (starpu-*.log): nothing measured";
      tail -n 20 "$W/starpu-configure.log" "$W/starpu-make.log" >>"$W/00-status.txt"; exit 1; }
  fi
  local starpu_version; starpu_version=$(sed -n 's/^Version: *//p' "$prefix"/lib/pkgconfig/starpu-1.4.pc)
  log "StarPU $starpu_version in $prefix"
  local llmc_ok=1
  wait "$llmc_pid" || { llmc_ok=0; status "FAILED: llm.c's build (llmc-build.log): no llmc series";
                        tail -n 5 "$W/llmc-build.log" >>"$W/00-status.txt"; }

  # ---- 2. starpu-llm with the carried wheels, linked to that OpenBLAS (rpath, no fallback)
  if [ -z "${EVAL_NO_WHEELS:-}" ]; then
    local whl=$E/whl; [ -d "$whl" ] || whl=$REPO/.device/wheels       # the GPU run's
    capped "$(cap 120)" $PY -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target "$W/site" "$whl"/*.whl >"$W/pip.log" 2>&1 ||
      { status "FAILED: the wheels (pip.log)"; tail -n 10 "$W/pip.log" >>"$W/00-status.txt"
        exit 1; }
  fi
  export PYTHONPATH=$W/site
  build_starpu_llm() {    # against StarPU in $1; a build folder per StarPU (reused by a 2nd call)
    PKG_CONFIG_PATH=$1/lib/pkgconfig capped "$(cap)" $PY -m pip install -q --no-index --no-deps \
      --no-build-isolation --no-compile --upgrade --target "$W/site" \
      -Cbuild-dir="$W/build-$(basename "$(dirname "$1")")-$(basename "$1")" \
      -Csetup-args=-Dcuda=disabled -Csetup-args=-Dopenblas_dir="$ob" \
      -Csetup-args=-Dopenblas_include="$ob_inc" -Csetup-args=-Dopenblas_required=true "$REPO" \
      >>"$W/pip.log" 2>&1
  }
  build_failed() {
    status "FAILED: building starpu-llm (pip.log): nothing measured"
    tail -n 30 "$W/pip.log" >>"$W/00-status.txt"; exit 1
  }
  if ! build_starpu_llm "$prefix"; then
    [ "$prefix" = "$gpu_starpu" ] && [ -f "$E/starpu-1.4.12-prefix.tar.gz" ] || build_failed
    status "building against the GPU run's StarPU failed (pip.log): the carried StarPU instead"
    rm -rf "$CARRIED_PREFIX" && tar -xzf "$E/starpu-1.4.12-prefix.tar.gz" -C "$(dirname "$CARRIED_PREFIX")"
    prefix=$CARRIED_PREFIX
    starpu_version=$(sed -n 's/^Version: *//p' "$prefix"/lib/pkgconfig/starpu-1.4.pc)
    build_starpu_llm "$prefix" || build_failed
  fi
  cd "$W"     # not the checkout: its starpu_llm/ has no compiled part
  {
    echo "host $(hostname); $(nproc) cores; $(uname -r); device machine $SL_DEVICE_KIND"
    capped 30 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    lscpu; free -g
    capped "$(cap 120)" $PY - <<'PY'
from starpu_llm._clib import ffi, lib
from starpu_llm.runtime.starpu import max_starpu_cpus, parallel_workers_here
v = [ffi.new("int *") for _ in range(3)]
lib.sl_starpu_version(*v)
print("starpu", ".".join(str(x[0]) for x in v), "maxcpus", max_starpu_cpus(),
      "parallel workers", bool(lib.sl_have_parallel_workers()), "mpi", bool(lib.sl_mpi_available()))
used, why = parallel_workers_here()
print("parallel workers used", used, why)
print("blas", ffi.string(lib.blas_name()).decode())
PY
    ldd "$W"/site/starpu_llm/_clib*.so
    ldd "$W/llmc/train_gpt2"
  } >"$W/env.txt" 2>&1
  local blas; blas=$(sed -n 's/^blas //p' "$W/env.txt")
  status "machine: $cpu; $(nproc) CPUs; device machine $SL_DEVICE_KIND; StarPU $starpu_version" \
         "($prefix); BLAS $blas"
  # Figure 3's K > 1 points are the paper's parallel workers: say it first if they are off
  grep -q "^parallel workers used True" "$W/env.txt" ||
    status "PARALLEL WORKERS OFF ($(sed -n 's/^parallel workers used //p' "$W/env.txt")):" \
           "the K > 1 points run on team workers"
  # ---- the BLAS checked: linked from $ob, the OpenMP build, and a k-core task's GEMM on k cores
  local kcore_ok=1 why="" rc
  if ! grep -q "libopenblas.so.0 => $ob/" "$W/env.txt"; then
    kcore_ok=0 why="starpu-llm's libopenblas is not $ob's (env.txt's ldd)"
  elif [ "${blas#openblas-openmp}" = "$blas" ]; then
    kcore_ok=0 why="the BLAS is $blas, not OpenBLAS's OpenMP build"
  elif capped "$(cap "${EVAL_PREFLIGHT_SECONDS:-90}")" $PY "$REPO/experiments/blas_preflight.py" \
         --partitions "${EVAL_PREFLIGHT:-4x4,1x16}" --model "$model" --json "$W/preflight.json" \
         >"$W/preflight.log" 2>&1; rc=$?; [ $rc -ne 0 ]; then
    kcore_ok=0 why="the preflight ($capped_how): $(tail -n 3 "$W/preflight.log" | tr '\n' ' ')"
  fi
  if [ $kcore_ok = 1 ]; then
    status "BLAS preflight ok: $(grep -v '^blas preflight: ok' "$W/preflight.log" | tr '\n' ' ')"
  else
    status "BLAS CHECK FAILED: $why -- the k > 1 points are not run"
  fi
  local only=${EVAL_ONLY:-fig3,fig2b,fig2a,fig2-llmc,fig4}
  if capped "$(cap 120)" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun \
       --oversubscribe --bind-to none -np 2 $PY -m starpu_llm train --model tiny --batch 4 \
       --seq-len 16 --steps 1 >"$W/mpi-smoke.log" 2>&1; then
    log "mpirun smoke run: ok"
  else
    status "FAILED: the mpirun smoke run (mpi-smoke.log): no Figure 4"
    tail -n 5 "$W/mpi-smoke.log" >>"$W/00-status.txt"
    only=$(echo "$only" | tr ',' '\n' | grep -v fig4 | paste -sd,)
  fi

  # the node's cores only, one hardware thread each (experiments/node_cores.py: starpu-llm's
  # count; CPUs 0-15 of a machine of 2 threads a core numbered side by side are 8 cores), and
  # said first when the machine has fewer than the plan's
  local cores=${EVAL_NODE_CORES:-16} pin=() node
  # (its stderr apart: a warning there would become the CPU list given to taskset)
  if node=$(cd "$W" && capped 30 $PY "$REPO/experiments/node_cores.py" --node-cores "$cores" \
               2>"$W/node_cores.err"); then
    [ -s "$W/node_cores.err" ] && log "node_cores.py said: $(cat "$W/node_cores.err")"
    status "${node#*$'\n'}"
    local use=${node%%$'\n'*}
    if [ "$(nproc)" -gt "$(echo "$use" | tr ',' '\n' | wc -l)" ]; then
      pin=(taskset -c "$use")
      log "$(nproc) CPUs here: calibration and runs on CPUs $use"
    fi
  else
    status "FAILED: counting the cores (experiments/node_cores.py): $node $(cat "$W/node_cores.err")"
  fi

  # ---- 3. the calibration, held out by configuration: CAL_PARTS only, no MPI link fit
  local cal=()
  local parts_py; parts_py=$(cal_parts | sed 's/\([0-9]*\)x\([0-9]*\)/(\1, \2)/g')
  if capped "$(cap "${EVAL_CAL_SECONDS:-150}")" "${pin[@]}" $PY -c "
from starpu_llm.perf.calibrate import calibrate
calibrate('$W/calibration.toml', steps=1, model='$model', quick=True, only=[$parts_py],
          link_run=False)" >"$W/calibrate.log" 2>&1; then
    cal=(--calibration "$W/calibration.toml")
    status "calibrated on $(cal_parts) at 1 and 6 sequences per worker: $(tail -n 2 \
            "$W/calibrate.log" | head -n 1)"
  else
    status "FAILED: the calibration (calibrate.log): no predictions; each point" \
           "${EVAL_MIN_STEPS:-3} timed steps"
    tail -n 5 "$W/calibrate.log" >>"$W/00-status.txt"
  fi

  # ---- 4. predict every point, cut the plan to the deadline, measure by priority
  local series=tensor,data extra=()
  [ $llmc_ok = 1 ] && series=$series,llmc
  [ $llmc_ok = 1 ] || only=$(echo "$only" | tr ',' '\n' | grep -v fig2-llmc | paste -sd,)
  [ $kcore_ok = 1 ] || extra+=(--one-core-only "BLAS check failed: $why")
  for f in "$W"/previous/runs-*.csv ${EVAL_RESUME:-}; do
    [ -f "$f" ] && extra+=(--resume "$f")
  done
  log "figures.py: $only; $(( RUNS_AT - $(date +%s) )) s left for them"
  # each timed run's processes marked and swept before the next run starts (the ranks a
  # timed-out mpirun may leave): none shares the next run's cores. figures.py ends its runs,
  # and their sweeps, by RUNS_AT; its cap, T_PACK, leaves it FIG_WRITE_S to write its files
  # shellcheck disable=SC2046
  PYTHONUNBUFFERED=1 capped "$(cap)" "${pin[@]}" $PY "$REPO/experiments/figures.py" \
    $(plan_args) --only "$only" --series "$series" --llmc "$W/llmc" "${cal[@]}" "${extra[@]}" \
    --deadline-at "$RUNS_AT" --no-plots --no-sgemm-peak --allow-dirty --out "$W/fig" \
    --run-env "$MARK_VAR=$MARK_RUNS" --after-each-run-seconds "$RUN_SWEEP_S" \
    --after-each-run "$(printf '%q ' env $RUN_SWEEP_WAITS bash "$REPO/tools/device-lib.sh" sweep \
                        "$MARK_RUNS")" 2>&1 |
    tee -a "$W/log.txt" | grep -E "NOT RUN|NOT IN|FAILED|predicted|sized|done in|the plan:|--resume"
  log "done"
}

case "${1:-}" in
  --prepare) prepare ;;
  --device) device ;;
  --dry-run) dry_run ;;
  --small)
    [ "${2:-}" = "--python" ] && [ -n "${3:-}" ] || die "--small --python PY312"
    export PYTHON=$3
    export EVAL_MODEL=${EVAL_MODEL:-tiny} EVAL_CORE_COUNTS=${EVAL_CORE_COUNTS:-1,2}
    export EVAL_WEAK=${EVAL_WEAK:-1} EVAL_STRONG=${EVAL_STRONG:-2} EVAL_FIG3=${EVAL_FIG3:-2,4}
    export EVAL_RANKS=${EVAL_RANKS:-1,2} EVAL_RESERVE=${EVAL_RESERVE:-0}
    export EVAL_MPI_BATCH=${EVAL_MPI_BATCH:-2} EVAL_POINT_SECONDS=${EVAL_POINT_SECONDS:-1}
    export EVAL_MAX_STEPS=${EVAL_MAX_STEPS:-3} EVAL_SECONDS=${EVAL_SECONDS:-900}
    export EVAL_LLMC_BATCHES=${EVAL_LLMC_BATCHES:-4} EVAL_CAL_PARTITIONS=${EVAL_CAL_PARTITIONS:-1x2}
    export EVAL_PREFLIGHT=${EVAL_PREFLIGHT:-1x2}
    export EVAL_NODE_CORES=${EVAL_NODE_CORES:-$(nproc)}
    export EVAL_WORK=${EVAL_WORK:-/tmp/eval16-small} OUT=${OUT:-/tmp/eval16-small-out}
    W=$EVAL_WORK
    device ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
