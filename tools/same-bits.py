"""The CUDA build trains on CPUs (no --gpus) to the same bits as a CPU build: a few AdamW steps
of the tiny model run by each build's `starpu-llm train` on the same default partition, then
their losses and their saved state (parameters, AdamW moments, step) compared exactly. Both
builds compile the same CPU kernels with the same flags and, without GPUs, give StarPU the
same codelets (no CUDA function), so nothing may differ.

    python tools/same-bits.py VENV_OF_THE_CPU_BUILD VENV_OF_THE_CUDA_BUILD

Exit status 0 when equal; 1 with the first difference named."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def train(venv: str, out: str) -> list:
    """The losses of venv's build over 3 steps; the model saved to out (and its state)."""
    cmd = [os.path.join(venv, "bin", "python"), "-m", "starpu_llm", "train", "--model", "tiny",
           "--batch", "4", "--seq-len", "64", "--steps", "3", "--lr", "1e-3",
           "--save", out, "--metrics-jsonl", out + ".jsonl"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out + ".jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def main(cpu_venv: str, cuda_venv: str) -> int:
    from starpu_llm.io import checkpoint
    with tempfile.TemporaryDirectory() as d:
        a, b = os.path.join(d, "cpu.bin"), os.path.join(d, "cuda.bin")
        la, lb = train(cpu_venv, a), train(cuda_venv, b)
        sa, sb = checkpoint.read(a), checkpoint.read(b)
    if la != lb:
        print(f"same-bits: the losses differ: {cpu_venv} {la}, {cuda_venv} {lb}")
        return 1
    for name in ("params", "m", "v"):
        x, y = getattr(sa, name), getattr(sb, name)
        if not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            n = int(np.sum(x.view(np.uint32) != y.view(np.uint32)))
            print(f"same-bits: {name} differ in {n} of {x.size} entries")
            return 1
    if sa.step != sb.step:
        print(f"same-bits: steps {sa.step} and {sb.step}")
        return 1
    print(f"same-bits: {cpu_venv} and {cuda_venv} (no GPUs): the same losses {la} and the same "
          f"parameters and AdamW moments, bit for bit")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
