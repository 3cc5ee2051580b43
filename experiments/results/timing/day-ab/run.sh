#!/bin/bash
# interleaved A/B: 2050c0d (old) against HEAD (new), make train's configuration, two partitions
out=/tmp/ab/ab.csv
echo "round,build,partition,tok_per_ms,line" > $out
for round in 1 2 3; do  # run twice here: rounds 1-3, then 4-6
  for build in old new; do
    dir=/work/main; [ $build = old ] && dir=/work/ab-old
    for part in "1x2" "2x1"; do
      args=""; [ $part = 2x1 ] && args="--workers 2 --cores-per-worker 1"
      line=$(cd $dir && .venv/bin/starpu-llm train --batch 4 --seq-len 64 --steps 11 $args 2>&1 | grep 'tokens/ms over')
      tpm=$(echo "$line" | sed -n 's/.*timed step(s): \([0-9.]*\).*/\1/p')
      echo "$round,$build,$part,$tpm,\"$line\"" >> $out
    done
  done
done
