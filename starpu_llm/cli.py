"""Command line: starpu-llm train | prepare | bench (also python -m starpu_llm)."""
from __future__ import annotations

import argparse
import sys

from .errors import StarpuLLMError


def _positive(flag):
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects a whole number, got {s!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {v}")
        return v
    return conv


def _nonneg_float(flag):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects a number, got {s!r}")
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {s}")
        return v
    return conv


def add_partition_args(p):
    g = p.add_argument_group("parallelism (StarPU engine)")
    g.add_argument("--workers", type=_positive("--workers"), help="N: parallel workers (default: 1)")
    g.add_argument("--cores-per-worker", type=_positive("--cores-per-worker"),
                   help="K: cores of each worker (default: all cores / N)")
    g.add_argument("--sub-batches", type=_positive("--sub-batches"),
                   help="split --batch into this many sub-batches (default: one per worker)")
    g.add_argument("--kcore", choices=["team", "forkjoin"],
                   help="how a task gets K > 1 cores without StarPU parallel workers: team (one "
                        "worker per K-core group with a bound OpenMP team; default) or forkjoin "
                        "(FORKJOIN tasks on combined workers, scheduler peager)")
    g.add_argument("--sched", help="StarPU scheduler (default: peager for forkjoin, else lws)")
    g.add_argument("--oversubscribe", action="store_true",
                   help="allow N x K above the usable cores (correctness tests only)")
    g.add_argument("--threads", type=_positive("--threads"),
                   help="reference engine: OpenMP/BLAS threads (default: all cores)")


def build_parser():
    from .config import MODELS
    ap = argparse.ArgumentParser(prog="starpu-llm", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train GPT-2 (default: 124M on the bundled Shakespeare)")
    t.add_argument("--model", default="d12", choices=sorted(MODELS),
                   help="model size when not initialised from a checkpoint (d12 = GPT-2 124M)")
    t.add_argument("--init-from", metavar="CKPT", help="llm.c fp32 checkpoint to start from")
    t.add_argument("--train-data", metavar="SHARD", help="llm.c token shard (default: bundled Shakespeare)")
    t.add_argument("--batch", "-b", type=_positive("--batch"), default=4, help="B, global batch (default 4)")
    t.add_argument("--seq-len", "-t", type=_positive("--seq-len"), default=64, help="T (default 64)")
    t.add_argument("--steps", "-n", type=_positive("--steps"), default=10, help="training steps (default 10)")
    t.add_argument("--lr", type=_nonneg_float("--lr"), default=1e-4, help="AdamW learning rate (default 1e-4)")
    t.add_argument("--weight-decay", type=_nonneg_float("--weight-decay"), default=0.0,
                   help="AdamW decoupled weight decay (default 0)")
    t.add_argument("--engine", choices=["starpu", "reference"], default="starpu",
                   help="starpu: the task graph; reference: the same kernels in a plain loop")
    t.add_argument("--seed", type=int, default=1337, help="seed of the random init")
    t.add_argument("--save", metavar="PATH", help="write the trained model (llm.c format)")
    t.add_argument("--metrics-jsonl", metavar="PATH", help="one JSON object per step")
    add_partition_args(t)

    pr = sub.add_parser("prepare", help="tokenize a text file into llm.c train/val shards")
    pr.add_argument("text", nargs="?", help="UTF-8 text file (default: the bundled Shakespeare)")
    pr.add_argument("--out-dir", default=".", help="where the shards go (default: .)")
    pr.add_argument("--val-tokens", type=_positive("--val-tokens"), default=32768)

    b = sub.add_parser("bench", help="tokens/ms of the engines (and PyTorch eager) side by side")
    b.add_argument("--model", default="d12", choices=sorted(MODELS))
    b.add_argument("--batches", default="1,4,8", help="comma-separated B values (default 1,4,8)")
    b.add_argument("--seq-len", type=_positive("--seq-len"), default=64)
    b.add_argument("--steps", type=_positive("--steps"), default=10, help="timed steps (default 10)")
    b.add_argument("--partitions", default="default",
                   help="StarPU partitions NxK, comma-separated, or 'all' (default: 1 x all cores)")
    b.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager reference")
    b.add_argument("--repeat", type=_positive("--repeat"), default=1,
                   help="runs of each configuration, interleaved round-robin; the median is "
                        "reported (default 1)")
    b.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    return ap


def cmd_train(args):
    from .trainer import TrainConfig, train
    cfg = TrainConfig(model=args.model, init_from=args.init_from, train_data=args.train_data,
                      batch=args.batch, seq_len=args.seq_len, steps=args.steps, lr=args.lr,
                      weight_decay=args.weight_decay, engine=args.engine, workers=args.workers,
                      cores_per_worker=args.cores_per_worker, sub_batches=args.sub_batches,
                      threads=args.threads, sched=args.sched, oversubscribe=args.oversubscribe,
                      kcore=args.kcore,
                      seed=args.seed, save=args.save, metrics_jsonl=args.metrics_jsonl)
    train(cfg)
    return 0


def cmd_prepare(args):
    from . import data
    source = args.text if args.text else data.shakespeare_text()
    train_path, val_path = data.prepare(source, args.out_dir, val_tokens=args.val_tokens,
                                        name=None if args.text else "shakespeare")
    print(f"wrote {train_path} and {val_path}")
    return 0


def cmd_bench(args):
    from .bench import run_bench
    run_bench(args)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": cmd_train, "prepare": cmd_prepare, "bench": cmd_bench}[args.cmd](args)
    except StarpuLLMError as e:
        print(f"starpu-llm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("starpu-llm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
