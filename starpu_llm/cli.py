"""Command line: starpu-llm train | prepare | bench | calibrate | predict | generate | serve
(also python -m starpu_llm)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from .bench import run_bench
from .cli_generate import run_generate
from .config import MODELS
from .errors import StarpuLLMError, flag as flag_of
from .io import corpus, data
from .perf.calibrate import calibrate
from .perf.machine import default_path, load, partitions
from .perf.predict import load_calibration, modes, predict
from .runtime.offload import parse_size
from .trainer import TrainConfig, train


def _checked(parse, kind: str, ok, rule: str):
    """An argparse type for a flag: parse the text (int, float), then check ok(value)."""
    def for_flag(flag):
        def conv(s):
            try:
                v = parse(s)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{flag} expects {kind}, got {s!r}")
            if not ok(v):
                raise argparse.ArgumentTypeError(f"{flag} must be {rule}, got {s}")
            return v
        return conv
    return for_flag


def _int_or(word):
    """A parser of a whole number, or of `word` itself."""
    return lambda s: word if s == word else int(s)


def _int_list(s):
    return [int(x) for x in s.split(",")]


_CHECKS = {"positive": _checked(int, "a whole number", lambda v: v >= 1, "at least 1"),
           "positive_or_auto": _checked(_int_or("auto"), "a whole number or auto",
                                        lambda v: v == "auto" or v >= 1, "at least 1, or auto"),
           "positive_or_all": _checked(_int_or("all"), "a whole number or all",
                                       lambda v: v == "all" or v >= 1, "at least 1, or all"),
           "positive_list": _checked(_int_list, "whole numbers separated by commas",
                                     lambda v: min(v) >= 1, "at least 1 each"),
           "nonneg": _checked(float, "a number", lambda v: v >= 0, ">= 0")}


def train_settings():
    """The TrainConfig fields that are `starpu-llm train` flags (those with help)."""
    return [f for f in fields(TrainConfig) if "help" in f.metadata]


def add_train_args(p):
    """One flag per train setting, generated from TrainConfig's fields and their metadata."""
    groups = {}
    for f in train_settings():
        m = f.metadata
        group = m.get("group")
        if group and group not in groups:
            groups[group] = p.add_argument_group(group)
        target = groups[group] if group else p
        flag = flag_of(f.name)
        names = [flag] + ([m["short"]] if "short" in m else [])
        kw = dict(dest=f.name, default=f.default, help=m["help"])
        if isinstance(f.default, bool):
            kw["action"] = "store_true"
        elif "check" in m:
            kw["type"] = _CHECKS[m["check"]](flag)
        elif f.default is not None:
            kw["type"] = type(f.default)
        for k in ("choices", "metavar"):
            if k in m:
                kw[k] = m[k]
        target.add_argument(*names, **kw)


def build_parser():
    ap = argparse.ArgumentParser(prog="starpu-llm", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train GPT-2 (default: 124M on the bundled Shakespeare)")
    add_train_args(t)

    pr = sub.add_parser("prepare", help="tokenize a text file into llm.c train/val shards")
    pr.add_argument("text", nargs="?", help="UTF-8 text file (default: the bundled Shakespeare)")
    pr.add_argument("--out-dir", default=".", help="where the shards go (default: .)")
    pr.add_argument("--val-tokens", type=_CHECKS["positive"]("--val-tokens"), default=32768)

    b = sub.add_parser("bench", help="tokens/ms of the engines (and PyTorch eager) side by side")
    b.add_argument("--model", default="d12", choices=sorted(MODELS))
    b.add_argument("--batches", default="1,4,8", help="comma-separated B values (default 1,4,8)")
    b.add_argument("--seq-len", type=_CHECKS["positive"]("--seq-len"), default=64)
    b.add_argument("--steps", type=_CHECKS["positive"]("--steps"), default=10, help="timed steps (default 10)")
    b.add_argument("--partitions", default="default",
                   help="StarPU partitions NxK, comma-separated, or 'all' (default: 1 x all cores)")
    b.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager reference")
    b.add_argument("--repeat", type=_CHECKS["positive"]("--repeat"), default=1,
                   help="runs of each configuration, interleaved round-robin; the median is "
                        "reported (default 1)")
    b.add_argument("--csv", metavar="PATH", help="also write the table as CSV")

    c = sub.add_parser("calibrate", help="measure this machine's cost model for `predict` "
                                         "(a few minutes; one file per machine)")
    c.add_argument("--out", metavar="PATH", help="where to write it (default: "
                                                 "~/.cache/starpu-llm/machine-HOST.toml)")
    c.add_argument("--steps", type=_CHECKS["positive"]("--steps"), default=2,
                   help="traced steps per calibration run, after one warm-up (default 2)")

    pd = sub.add_parser("predict", help="predict tokens/ms of a configuration from the task "
                                        "graph and the calibrated cost model")
    pd.add_argument("--model", default="d12", choices=sorted(MODELS))
    pd.add_argument("--batch", type=_CHECKS["positive"]("--batch"), default=4,
                    help="sequences per step (default 4); with a list of --ranks, per rank (weak "
                         "scaling, as the paper's Figure 4)")
    pd.add_argument("--seq-len", type=_CHECKS["positive"]("--seq-len"), default=64)
    pd.add_argument("--workers", type=_CHECKS["positive_or_all"]("--workers"), default=1,
                    help="N, or all: every N x K partition of the machine's cores, one line each "
                         "(the paper's Figure 3)")
    pd.add_argument("--cores-per-worker", type=_CHECKS["positive"]("--cores-per-worker"),
                    default=None, help="default: all cores over the workers")
    pd.add_argument("--sub-batches", type=_CHECKS["positive"]("--sub-batches"), default=None,
                    help="per rank (default: one per worker)")
    pd.add_argument("--ranks", type=_CHECKS["positive_list"]("--ranks"), default=[1],
                    help="MPI processes, one per node (default 1); a comma-separated list "
                         "predicts each (1,2,4,8,16: the paper's Figure 4, tokens/ms per node)")
    pd.add_argument("--ownership", default="sharded", metavar="MODES",
                    help="with --ranks above 1, who owns the parameter slices: sharded, rank0, "
                         "a comma-separated list, or all; several modes are printed best first "
                         "for each rank count (default sharded)")
    pd.add_argument("--pipeline-stages", default="1", metavar="S",
                    help="pipeline stages (R = S x data-parallel copies): a comma-separated list, "
                         "or all (every S dividing R), each with each --ownership (default 1); a "
                         "pipeline wants many micro-batches: --sub-batches (per copy)")
    pd.add_argument("--memory-limit", metavar="SIZE",
                    help="one process training under `train --memory-limit SIZE`: the disk "
                         "traffic of StarPU's eviction and its time at the calibrated disk "
                         "bandwidth are added")
    pd.add_argument("--calibration", metavar="PATH", help="this machine's calibration file")
    pd.add_argument("--machine", metavar="FILE", help="predict for another machine described "
                                                      "in FILE (TOML, see experiments/machines/)")

    g = sub.add_parser("generate", help="continue a prompt with a model (llm.c checkpoint with "
                                        "GPT-2's vocabulary), printing the text as it comes")
    g.add_argument("--init-from", required=True, metavar="CKPT", help="llm.c fp32 checkpoint")
    g.add_argument("--prompt", default="", help="text to continue (default: none, start from "
                                                "<|endoftext|>)")
    g.add_argument("--max-new-tokens", type=_CHECKS["positive"]("--max-new-tokens"), default=64,
                   help="tokens to generate (default 64); prompt + new tokens <= the model's maxT")
    g.add_argument("--temperature", type=_CHECKS["nonneg"]("--temperature"), default=1.0,
                   help="softmax temperature (default 1; 0: greedy)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default 0: all; 1: greedy)")
    g.add_argument("--seed", type=int, default=1337, help="seed of the sampling (default 1337)")
    g.add_argument("--engine", default="starpu", choices=["starpu", "reference"],
                   help="starpu: the task graph with a key/value cache; reference: the same "
                        "kernels in a plain loop")

    sv = sub.add_parser("serve", help="serve a model (llm.c checkpoint with GPT-2's vocabulary) "
                                      "over HTTP with OpenAI's completions API, batching the "
                                      "requests (docs/serving.md)")
    sv.add_argument("--init-from", required=True, metavar="CKPT", help="llm.c fp32 checkpoint")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                                                        "127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_checked(int, "a port number", lambda v: 0 <= v < 65536,
                                            "in 0..65535")("--port"), default=8000,
                    help="TCP port (default 8000; 0: a free one, printed)")
    sv.add_argument("--max-batch", type=_CHECKS["positive"]("--max-batch"), default=8,
                    help="sequences generated at once, each in a slot of the key/value cache "
                         "(default 8)")
    sv.add_argument("--max-queue", type=_checked(int, "a whole number", lambda v: v >= 0,
                                                 ">= 0")("--max-queue"), default=64,
                    help="requests waiting for a slot beyond those; more are refused with HTTP "
                         "503 and Retry-After (default 64)")
    sv.add_argument("--engine", default="starpu", choices=["starpu", "reference"],
                    help="starpu: the task graph; reference: the same kernels in a plain loop")
    sv.add_argument("--workers", type=_CHECKS["positive"]("--workers"), default=None,
                    help="N StarPU workers (default: one on every core); with N > 1 the slots "
                         "are split into N groups that step side by side")
    sv.add_argument("--cores-per-worker", type=_CHECKS["positive"]("--cores-per-worker"),
                    default=None, help="K cores per worker (default: all cores over the workers)")
    sv.add_argument("--kcore", default=None, choices=["team", "forkjoin"],
                    help="how a task gets K > 1 cores without StarPU parallel workers "
                         "(default team)")
    sv.add_argument("--model-name", default=None, help="the model's name in the API (default: "
                                                       "the checkpoint's file name, without "
                                                       "its extension)")
    sv.add_argument("--shutdown-timeout", type=_CHECKS["nonneg"]("--shutdown-timeout"),
                    default=30.0, help="seconds the running requests get to finish after "
                                       "SIGINT or SIGTERM, before they are cancelled (default 30)")
    sv.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level (info: one line per request)")
    return ap


def cmd_train(args):
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in train_settings()})
    train(cfg)
    return 0


def cmd_prepare(args):
    source = args.text if args.text else corpus.shakespeare_text()
    train_path, val_path = data.prepare(source, args.out_dir, val_tokens=args.val_tokens,
                                        name=None if args.text else "shakespeare")
    print(f"wrote {train_path} and {val_path}")
    return 0


def cmd_bench(args):
    run_bench(args)
    return 0


def cmd_calibrate(args):
    calibrate(args.out or default_path(), steps=args.steps)
    return 0


def cmd_predict(args):
    calibration = load_calibration(args.calibration)
    machine = load(args.machine) if args.machine else None
    target = machine or calibration
    if args.workers == "all":
        if args.cores_per_worker:
            raise StarpuLLMError("--workers all takes every N x K of the machine's cores: "
                                 "leave --cores-per-worker out")
        parts = [p for p in partitions(target.cores) if args.batch % p[0] == 0]
    else:
        parts = [(args.workers, args.cores_per_worker or max(1, target.cores // args.workers))]
    # a described machine runs K-core workers as StarPU 1.4 parallel workers (the clusters')
    pw = True if machine is not None else None
    weak = len(args.ranks) > 1        # --batch per rank; efficiency against one node
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    print(f"machine: {target.name}")
    for n, cores_per_worker in parts:
        def at(R, mode):
            return predict(args.model, args.batch * R if weak else args.batch, args.seq_len, n,
                           cores_per_worker, ranks=R, sub_batches=args.sub_batches,
                           calibration=calibration, machine=machine, parallel_workers=pw,
                           mode=mode, memory_limit=limit)
        one = at(1, modes(1, "sharded", "1", args.model)[0]).tokens_per_ms if weak else None
        for R in args.ranks:
            ranked = sorted((at(R, mode) for mode in modes(R, args.ownership, args.pipeline_stages,
                                                           args.model)),
                            key=lambda p: -p.tokens_per_ms)
            for p in ranked:
                per_node = (f" ({p.tokens_per_ms / R:.4f} tok/ms per node"
                            + (f", {p.tokens_per_ms / R / one:.0%} of one node's" if weak else "")
                            + ")") if R > 1 else ""
                print(p.describe() + per_node, flush=True)
    return 0


def cmd_generate(args):
    run_generate(args.init_from, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                 args.seed, args.engine)
    return 0


def cmd_serve(args):
    from .cli_serve import run_serve
    return run_serve(args.init_from, args.host, args.port, args.max_batch, args.max_queue,
                     args.engine, args.workers, args.cores_per_worker, args.kcore,
                     args.model_name, args.shutdown_timeout, args.log_level)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": cmd_train, "prepare": cmd_prepare, "bench": cmd_bench,
                "calibrate": cmd_calibrate, "predict": cmd_predict,
                "generate": cmd_generate, "serve": cmd_serve}[args.cmd](args)
    except StarpuLLMError as e:
        print(f"starpu-llm: error: {e.render(flag_of)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("starpu-llm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
