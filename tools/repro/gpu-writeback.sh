#!/usr/bin/env bash
# StarPU's background write-back of dirty GPU buffers, measured (starpu_llm/runtime/starpu.py,
# KEEP_DIRTY; docs/gpus.md, "StarPU's clean buffers"): one device command that builds as
# tools/device-gpu.sh does, then trains GPT-2 124M at B = 8, T = 1024 on the GPU twice, with the
# runtime's setting (no write-back) and with StarPU's defaults (5 % / 10 % clean buffers) set
# explicitly, which the runtime leaves alone. Each run's log lands in $OUT.
#
#   tools/device-gpu.sh --prepare LLMC      # here, once
#   run(command="tools/repro/gpu-writeback.sh", carry=[".device"], timeout_s=300)
#
# On an H200 (2026-11-28, experiments/results/gpu/h200/writeback.csv): 260 ms a step without
# the write-back, 690-1730 ms with it.
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
SL_DEADLINE=230 tools/device-gpu.sh preflight build || exit 1
export PYTHONPATH=/tmp/sl-gpu/site:/tmp/sl-gpu/starpu-llm STARPU_HOME=/tmp/sl-gpu/starpu-home \
       PYTHONUNBUFFERED=1
cd /tmp/sl-gpu
for mode in keep-dirty starpu-default; do
  [ $mode = starpu-default ] && export STARPU_MINIMUM_CLEAN_BUFFERS=5 STARPU_TARGET_CLEAN_BUFFERS=10
  echo "== $mode at +${SECONDS}s"
  timeout 45 python3 -m starpu_llm train --model d12 --gpus 1 --batch 8 --seq-len 1024 --steps 7 \
      2>&1 | grep -v "^\[starpu\]" | tee "$OUT/writeback-$mode.log"
done
