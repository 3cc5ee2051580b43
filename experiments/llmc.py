"""llm.c's CPU trainer (train_gpt2.c) as the paper's baseline: its matmuls on cblas_sgemm (the
paper: "KARPATY's code was modified only to use the GEMM routine provided by the MKL"), built
against an OpenMP OpenBLAS and run as one more series of the figures (figures.py --llmc DIR).

llm.c itself is never in this repository: a copy fetched elsewhere (its repository at commit
f1e2ace, `train_gpt2.c` and the `llmc/` headers it includes) is patched here into a build
folder, with `patch` below, which changes only:
  - matmul_forward and matmul_backward: the same products as cblas_sgemm calls (row-major;
    the bias added and summed in an OpenMP loop), the CBLAS prototype declared here;
  - main: the checkpoint, B, T and the number of steps from the environment (LLMC_CHECKPOINT,
    LLMC_B, LLMC_T, LLMC_STEPS; llm.c's own values by default), and no validation loss or
    sample generation between steps (they are outside the timed step anyway, but cost time).
Each `took X ms` line is one step: the forward, zero_grad, backward and AdamW update, timed by
llm.c. The first is the warm-up, as for the other series.

    python experiments/llmc.py build SRC_DIR OUT_DIR --openblas DIR   # patch + gcc
    python experiments/llmc.py checkpoint OUT_DIR [--model d12]       # llm.c's inputs in OUT_DIR
    python experiments/llmc.py run OUT_DIR --batch 4 --threads 2 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

CHECKPOINT = "model.bin"             # written by `checkpoint`, read through LLMC_CHECKPOINT
DATA = os.path.join("dev", "data", "tinyshakespeare")   # where train_gpt2.c looks for tokens
STEP_LINE = re.compile(r"^step (\d+): train loss ([-+0-9.eEnaif]+) \(took ([0-9.eE+-]+) ms\)",
                       re.M)

CBLAS = """
// starpu-llm's patch (experiments/llmc.py): the matmuls on CBLAS, as the paper built llm.c
enum SlCblasOrder { SlCblasRowMajor = 101 };
enum SlCblasTranspose { SlCblasNoTrans = 111, SlCblasTrans = 112 };
void cblas_sgemm(enum SlCblasOrder order, enum SlCblasTranspose ta, enum SlCblasTranspose tb,
                 int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                 int ldb, float beta, float *c, int ldc);
static int llmc_env(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}
"""

MATMUL_FORWARD = """void matmul_forward(float* out,
                    const float* inp, const float* weight, const float* bias,
                    int B, int T, int C, int OC) {
    // inp (B,T,C), weight (OC,C), bias (OC) -> out (B,T,OC) = inp weight^T + bias
    int BT = B * T;
    cblas_sgemm(SlCblasRowMajor, SlCblasNoTrans, SlCblasTrans, BT, OC, C,
                1.0f, inp, C, weight, C, 0.0f, out, OC);
    if (bias != NULL) {
        #pragma omp parallel for
        for (int bt = 0; bt < BT; bt++) {
            float* o = out + (size_t)bt * OC;
            for (int i = 0; i < OC; i++) { o[i] += bias[i]; }
        }
    }
}
"""

MATMUL_BACKWARD = """void matmul_backward(float* dinp, float* dweight, float* dbias,
                     const float* dout, const float* inp, const float* weight,
                     int B, int T, int C, int OC) {
    // dout (B,T,OC); accumulates, as llm.c's loops do:
    // dinp (B,T,C) += dout weight, dweight (OC,C) += dout^T inp, dbias (OC) += sum over B,T
    int BT = B * T;
    cblas_sgemm(SlCblasRowMajor, SlCblasNoTrans, SlCblasNoTrans, BT, C, OC,
                1.0f, dout, OC, weight, C, 1.0f, dinp, C);
    cblas_sgemm(SlCblasRowMajor, SlCblasTrans, SlCblasNoTrans, OC, C, BT,
                1.0f, dout, OC, inp, C, 1.0f, dweight, C);
    if (dbias != NULL) {
        #pragma omp parallel for
        for (int o = 0; o < OC; o++) {
            float sum = 0.0f;
            for (int bt = 0; bt < BT; bt++) { sum += dout[(size_t)bt * OC + o]; }
            dbias[o] += sum;
        }
    }
}
"""

# (what is replaced, by what): each must occur exactly once in train_gpt2.c
MAIN_EDITS = (
    ('gpt2_build_from_checkpoint(&model, "gpt2_124M.bin");',
     'gpt2_build_from_checkpoint(&model, getenv("LLMC_CHECKPOINT") ? getenv("LLMC_CHECKPOINT")'
     ' : "gpt2_124M.bin");'),
    ("int B = 4;", 'int B = llmc_env("LLMC_B", 4);'),
    ("int T = 64;", 'int T = llmc_env("LLMC_T", 64); int llmc_steps = llmc_env("LLMC_STEPS", 41);'),
    ("for (int step = 0; step <= 40; step++) {", "for (int step = 0; step < llmc_steps; step++) {"),
    ("if (step % 10 == 0) {", "if (0 && step % 10 == 0) {"),          # no validation loss
    ("if (step > 0 && step % 20 == 0) {", "if (0 && step % 20 == 0) {"),  # no generation
)


class PatchError(RuntimeError):
    pass


def _function(text: str, name: str) -> tuple[int, int]:
    """(start, end) of the definition of `void name(` up to its closing brace at column 0."""
    starts = [m.start() for m in re.finditer(rf"^void {name}\(", text, re.M)]
    if len(starts) != 1:
        raise PatchError(f"train_gpt2.c: expected one definition of {name}, found {len(starts)} "
                         "(another llm.c version? this patch was written for commit f1e2ace)")
    end = text.find("\n}\n", starts[0])
    if end < 0:
        raise PatchError(f"train_gpt2.c: no end to {name}")
    return starts[0], end + 3


def patch(text: str) -> str:
    """train_gpt2.c's text with the changes of the module's doc; PatchError where an expected
    piece is missing or ambiguous (nothing is patched silently half-way)."""
    for name, body in (("matmul_forward", MATMUL_FORWARD), ("matmul_backward", MATMUL_BACKWARD)):
        a, b = _function(text, name)
        text = text[:a] + body + text[b:]
    for old, new in MAIN_EDITS:
        n = text.count(old)
        if n != 1:
            raise PatchError(f"train_gpt2.c: expected {old!r} once, found it {n} times "
                             "(another llm.c version? this patch was written for commit f1e2ace)")
        text = text.replace(old, new)
    anchor = '#include "llmc/utils.h"'
    if text.count(anchor) != 1:
        raise PatchError(f"train_gpt2.c: expected {anchor!r} once")
    return text.replace(anchor, anchor + "\n" + CBLAS)


def build(src: str, out: str, openblas: str, cc: str = "gcc", log=print) -> str:
    """Patch src/train_gpt2.c (with its llmc/ headers) into out and compile it against the
    libopenblas.so.0 in the folder `openblas`; the binary's path."""
    os.makedirs(os.path.join(out, "llmc"), exist_ok=True)
    with open(os.path.join(src, "train_gpt2.c"), encoding="utf-8") as f:
        text = patch(f.read())
    with open(os.path.join(out, "train_gpt2.c"), "w", encoding="utf-8") as f:
        f.write(text)
    for h in os.listdir(os.path.join(src, "llmc")):
        if h.endswith(".h"):
            with open(os.path.join(src, "llmc", h), "rb") as f, \
                    open(os.path.join(out, "llmc", h), "wb") as g:
                g.write(f.read())
    lib = os.path.join(os.path.abspath(openblas), "libopenblas.so.0")
    if not os.path.exists(lib):
        raise FileNotFoundError(f"{lib}: no libopenblas.so.0 in --openblas {openblas}")
    binary = os.path.join(out, "train_gpt2")
    # llm.c's Makefile flags for the CPU trainer (-Ofast, -march=native, OpenMP)
    cmd = [cc, "-Ofast", "-march=native", "-fopenmp", "-DOMP", "-Wno-unused-result",
           "-o", binary, os.path.join(out, "train_gpt2.c"), lib,
           f"-Wl,-rpath,{os.path.dirname(lib)}", "-lm"]
    log(" ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if p.returncode != 0:
        raise RuntimeError(f"compiling llm.c failed:\n{p.stderr[-3000:]}")
    return binary


def checkpoint(out: str, model: str = "d12", log=print) -> None:
    """llm.c's inputs in out: `model`'s GPT-2 initialisation as an llm.c checkpoint, and the
    bundled Shakespeare's token shards where train_gpt2.c looks for them."""
    from starpu_llm.model.config import MODELS
    from starpu_llm.io import data, formats
    from starpu_llm.model.state import random_init
    t0 = time.time()
    config = MODELS[model]
    formats.write_checkpoint(os.path.join(out, CHECKPOINT), config, random_init(config))
    train, val = data.default_dataset()
    folder = os.path.join(out, DATA)
    os.makedirs(folder, exist_ok=True)
    for src, name in ((train, "tiny_shakespeare_train.bin"), (val, "tiny_shakespeare_val.bin")):
        dst = os.path.join(folder, name)
        if os.path.lexists(dst):
            os.unlink(dst)
        os.symlink(os.path.abspath(src), dst)
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(dict(model=model), f)
    log(f"llm.c inputs in {out}: {model} checkpoint, Shakespeare shards ({time.time() - t0:.1f} s)")


def parse_steps(stdout: str) -> tuple[list, list]:
    """(losses, ms) of each `step N: train loss L (took X ms)` line, in order."""
    rows = STEP_LINE.findall(stdout)
    return [float(loss) for _, loss, _ in rows], [float(ms) for _, _, ms in rows]


def run(spec: dict, folder: str, timeout: float | None = None) -> dict:
    """One figure point of the llm.c series, as run_in_subprocess returns a StarPU one: spec
    with step_ms (the timed steps: all but the first), tokens_per_ms, peak_rss_mb, describe
    and losses; or spec with "error". spec: batch, seq_len, steps (timed), threads (OpenMP
    threads, default every usable core), cpus (the first cpus of this process's cores)."""
    from starpu_llm.perf.runs import run_sampling_rss
    binary = os.path.join(folder, "train_gpt2")
    try:
        with open(os.path.join(folder, "model.json")) as f:
            model = json.load(f)["model"]
    except (OSError, ValueError, KeyError):
        return dict(spec, error=f"{folder}: no model.json (run `experiments/llmc.py checkpoint`)")
    if model != spec["model"]:
        return dict(spec, error=f"{folder} holds a {model} checkpoint, the point wants "
                                f"{spec['model']}")
    if not os.access(binary, os.X_OK):
        return dict(spec, error=f"{binary}: not built (experiments/llmc.py build)")
    from starpu_llm.runtime.cpus import core_cpus     # one hardware thread a core
    cores = core_cpus()[:int(spec.get("cpus") or len(core_cpus()))]
    threads = int(spec.get("threads") or len(cores))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), LLMC_CHECKPOINT=CHECKPOINT,
               LLMC_B=str(spec["batch"]), LLMC_T=str(spec["seq_len"]),
               LLMC_STEPS=str(int(spec["steps"]) + 1))
    env.pop("OPENBLAS_NUM_THREADS", None)     # the OpenMP build follows OMP_NUM_THREADS
    out_path = os.path.join(folder, "last.out")
    err_path = os.path.join(folder, "last.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        status, peak = run_sampling_rss([binary], out, err, env=env, timeout=timeout, cwd=folder,
                                        preexec_fn=lambda: os.sched_setaffinity(0, cores))
    stdout = open(out_path).read()
    losses, ms = parse_steps(stdout)
    if status != 0 or len(ms) != int(spec["steps"]) + 1:
        tail = (open(err_path).read().strip().splitlines() or stdout.strip().splitlines()
                or ["no output"])[-1]
        why = "timed out (killed)" if status == -9 else f"exit {status}"
        return dict(spec, error=f"llm.c {why}, {len(ms)} step line(s): {tail}")
    timed = ms[1:]
    return dict(spec, step_ms=timed, losses=losses,
                tokens_per_ms=spec["batch"] * spec["seq_len"] * len(timed) / sum(timed),
                peak_rss_mb=peak / 2 ** 20,
                describe=f"llm.c train_gpt2.c + cblas_sgemm, {threads} OpenMP thread(s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="patch train_gpt2.c into OUT and compile it")
    b.add_argument("src", help="the fetched llm.c folder (train_gpt2.c, llmc/)")
    b.add_argument("out")
    b.add_argument("--openblas", required=True, help="folder of the OpenMP libopenblas.so.0")
    c = sub.add_parser("checkpoint", help="write llm.c's checkpoint and token files into OUT")
    c.add_argument("out")
    c.add_argument("--model", default="d12")
    r = sub.add_parser("run", help="run one point, print its result as JSON")
    r.add_argument("out")
    r.add_argument("--model", default="d12")
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--seq-len", type=int, default=64)
    r.add_argument("--steps", type=int, default=3, help="timed steps (one more: the warm-up)")
    r.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build(args.src, args.out, args.openblas))
        elif args.cmd == "checkpoint":
            checkpoint(args.out, args.model)
        else:
            res = run(dict(engine="llmc", model=args.model, batch=args.batch, seq_len=args.seq_len,
                           steps=args.steps, threads=args.threads), args.out)
            print(json.dumps(res))
            return 1 if "error" in res else 0
    except (PatchError, RuntimeError, FileNotFoundError) as e:
        print(f"llmc.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
