"""Command line: starpu-llm train | prepare | bench | calibrate | predict | generate |
serve | eval | convert (also python -m starpu_llm).

Errors end the command with one message and status 2; under mpirun rank 0 reports an error
that every rank knows (runtime/mpi.phase: a bad flag, a file missing on one node, settings
that differ), and an error that only one rank has in the middle of the run (after the ranks
last met) ends the whole job through MPI_Abort, so that no rank is left waiting. A signal ends
it as signals.py says (130 for Ctrl-C, 143 for SIGTERM, 138 for SIGUSR1, 129 for SIGHUP; 141
when its stdout or stderr is closed)."""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import traceback
from dataclasses import fields

# Only what a signal during start-up needs is imported here: the rest is imported by the
# commands, once main() handles signals (a Ctrl-C while numpy loads is no traceback).
from . import compiled_part_missing, signals
from .errors import StarpuLLMError, flag as flag_of
from .plan.settings import CHECKS


class UsageError(StarpuLLMError):
    """A command line argparse cannot parse: the usage line and the message."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)    # --cores-per-worke is no --cores-per-worker
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{self.format_usage()}{self.prog}: error: {message}")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but words no parser knows are an error of the command they follow,
        with that command's usage (`train --nosuch`: train's, not the top level's)."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            command = self
            for a in self._actions:
                if isinstance(a, argparse._SubParsersAction):
                    command = a.choices.get(getattr(ns, a.dest, None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def version_text() -> str:
    """`starpu-llm --version`: this package's version and, without starting StarPU, the StarPU
    the compiled part loads and what the build has."""
    from . import __version__
    lines = [f"starpu-llm {__version__}"]
    try:
        from .runtime import starpu as rt
    except ImportError as e:
        return "\n".join(lines + [f"compiled part: not loaded ({e})"])
    major, minor, release = (rt.ffi.new("int *") for _ in range(3))
    rt.lib.sl_starpu_version(major, minor, release)
    library = rt.ffi.string(rt.lib.sl_starpu_library()).decode()
    build = rt.this_build()
    if build.parallel_workers:
        workers = "yes"
    elif not rt.lib.sl_have_parallel_workers():
        workers = "no (not in this StarPU build)"
    else:
        workers = "off (" + (rt.parallel_workers_here()[1] or "SL_NO_PARALLEL_WORKERS is set") + ")"
    yes = {True: "yes", False: "no"}
    cuda = yes[build.cuda]
    if build.cuda:
        from ._build import GPU_ARCH
        seen = rt.cuda_devices()
        details = cuda_text(GPU_ARCH, rt.lib.sl_gpu_runtime_version(),
                            rt.lib.sl_gpu_driver_version(), seen,
                            [rt.lib.sl_gpu_device_cc(d) for d in range(seen[0])])
        cuda += f" ({details})"
    lines += [f"StarPU {major[0]}.{minor[0]}.{release[0]}"
              f"{f' ({os.path.realpath(library)})' if library else ''}, "
              f"STARPU_MAXCPUS {build.max_cpus}",
              f"StarPU-MPI: {yes[bool(rt.lib.sl_mpi_available())]}, CUDA: {cuda}, "
              f"parallel workers: {workers}",
              f"BLAS: {rt.ffi.string(rt.lib.blas_name()).decode()}",
              f"kernels: {_kernels_isa()}"]
    return "\n".join(lines)


def gpu_arch_runs(cc: int, archs: list) -> bool:
    """Whether kernels built for archs (compute capabilities x10: the code of each, the PTX of
    the last) run on a GPU of compute capability cc: a code of its major version no newer than
    it, or the PTX of one no newer, which the driver compiles for it."""
    return any(a // 10 == cc // 10 and a <= cc for a in archs) or (bool(archs) and archs[-1] <= cc)


def cuda_text(gpu_arch: str, runtime: int, driver: int, seen: tuple, ccs: list) -> str:
    """A CUDA build's details in --version, what to check on a node before queuing a job: the
    CUDA it was built with (runtime, CUDART_VERSION) and for which GPUs (gpu_arch, _build.py's),
    the driver's CUDA (0: none), then the GPUs seen (seen: runtime.cuda_devices' count and
    error), each by its compute capability x10 in ccs (negative: -(its cudaError)) and whether
    the kernels run on it."""
    def cuda(v):
        return f"CUDA {v // 1000}.{v % 1000 // 10}"
    archs = [int(a) for a in gpu_arch.split()]
    text = (f"built with {cuda(runtime)} for {' '.join(f'sm_{a}' for a in archs)} + PTX "
            f"compute_{archs[-1]}; driver: {cuda(driver) if driver else 'none found'}; ")
    n, why = seen
    if why:
        return text + why
    gpus = []
    for d, cc in enumerate(ccs):
        if cc < 0:
            gpus.append(f"{d}: cudaError {-cc}")
        elif gpu_arch_runs(cc, archs):
            gpus.append(f"{d}: sm_{cc}")
        else:
            gpus.append(f"{d}: sm_{cc}, which this build's kernels do not run on (rebuild with "
                        f"-Dgpu_arch={','.join(map(str, sorted(set(archs) | {cc})))})" if cc >= 80 else
                        f"{d}: sm_{cc}, older than the kernels' sm_80")
    return text + f"{n} GPU(s) seen" + (f": {', '.join(gpus)}" if gpus else "")


def _kernels_isa() -> str:
    """What the kernels were compiled for (meson's `native` option; kernels/cpu.py), and
    whether this CPU has it."""
    try:
        from ._build import ISA
    except ImportError:
        return "unknown (no build record)"
    from .kernels.cpu import missing as lacking
    missing = lacking(ISA)
    return ((f"-march=native ({ISA})" if ISA else "portable (-Dnative=false)")
            + (f"; this CPU lacks {', '.join(missing)}: they cannot run here" if missing else ""))


class _Version(argparse.Action):
    """--version: version_text, then the end (as --help), computed only when asked."""
    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


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


def _given(flag, optional: bool = True):
    """An argparse type for a path or name: not empty (an unset $VARIABLE in a script: `--resume
    ""` would start a new run, `--save ""` save nothing)."""
    def conv(s):
        if not s.strip():
            raise argparse.ArgumentTypeError(f"{flag} is empty: give a value"
                                             + (f", or leave {flag} out" if optional else ""))
        return s
    return conv


def _listed(values) -> str:
    """A list flag's default as the flag takes it: comma-separated."""
    return ",".join(map(str, values))


def _train_settings():
    from .training.trainer import TrainConfig
    return [f for f in fields(TrainConfig) if "help" in f.metadata]


# each check of plan/settings.CHECKS as an argparse type for a flag
_CHECKS = {name: _checked(c.parse, c.kind, c.ok, c.rule) for name, c in CHECKS.items()}


def _model_name(s):
    """serve --model-name: what clients send as "model", so neither empty nor padded."""
    if s.strip() != s or not s:
        raise argparse.ArgumentTypeError(f"--model-name must be a name clients can send as "
                                         f"\"model\" (not empty, no spaces around it), got {s!r}")
    return s


def train_settings():
    """The TrainConfig fields that are `starpu-llm train` flags (those with help)."""
    return _train_settings()


def train_settings_named(*names):
    """The train settings of these names, in declaration order: bench's and predict's flags
    that mean what train's do (the same default, rule and short option)."""
    return [f for f in train_settings() if f.name in names]


def _sweep(conv, flag: str, choices):
    """An argparse type for a sweep field in bench and predict: a comma-separated list of
    values (each as train takes it: conv, or one of choices), or auto: every value that fits
    (bench and predict say which)."""
    def parse(s):
        if s == "auto":
            return "auto"
        items = [conv(x) if conv else x for x in s.split(",")]
        for x in items:
            if choices and x not in choices:
                raise argparse.ArgumentTypeError(f"{flag} {x!r}: choose among "
                                                 f"{', '.join(choices)}, a comma-separated list of "
                                                 f"them, or auto")
            if x == "auto":
                raise argparse.ArgumentTypeError(f"{flag}: auto stands alone")
        return items
    return parse


def add_setting_args(p, settings, sweep: bool = False, overrides=None, defaults: bool = True):
    """One flag per setting (a dataclass field made by settings.setting), from its metadata;
    with sweep, the fields marked sweep take a list of values (_sweep); overrides: {field
    name: argparse keywords} where a command means less than the setting (serve's --workers);
    without defaults, a flag not given leaves no attribute (given_train_settings)."""
    groups = {}
    for f in settings:
        m = f.metadata
        group = m.get("group")
        if group and group not in groups:
            groups[group] = p.add_argument_group(group)
        target = groups[group] if group else p
        flag = flag_of(f.name)
        names = [flag] + ([m["short"]] if "short" in m else [])
        kw = dict(dest=f.name, default=f.default if defaults else argparse.SUPPRESS,
                  help=m["help"])
        conv = None
        if "check" in m:
            conv = _CHECKS[m["check"]](flag)
        elif f.default is not None and not isinstance(f.default, bool):
            conv = type(f.default)
        if conv in (None, str) and "choices" not in m:
            conv = _given(flag)
        if sweep and m.get("sweep"):
            kw["type"] = _sweep(conv, flag, m.get("choices"))
            kw["help"] += ("; a comma-separated list, one configuration each, or auto: every "
                           "one that fits")
        elif isinstance(f.default, bool):
            kw["action"] = "store_true"
        else:
            if conv is not None:
                kw["type"] = conv
            if "choices" in m:
                kw["choices"] = m["choices"]
        if "metavar" in m:
            kw["metavar"] = m["metavar"]
        kw.update((overrides or {}).get(f.name, {}))
        target.add_argument(*names, **kw)


def add_train_args(p):
    """One flag per train setting, generated from TrainConfig's fields and their metadata."""
    add_setting_args(p, train_settings())


def partition_settings(*names):
    """The PartitionRequest fields of these names, in declaration order."""
    from .plan.partition import PartitionRequest
    return [f for f in fields(PartitionRequest) if f.name in names]


def serving_settings(*names):
    """serve/settings.Serving's fields of these names, in declaration order."""
    from .serve.settings import Serving     # a plain dataclass: no serve extra needed
    return [f for f in fields(Serving) if f.name in names]


# the partition flags of serve and generate (PartitionRequest fields), declared and read back
# by name
DECODE_PARTITION = ("workers", "cores_per_worker", "kcore", "sched", "gpus", "gpu_matmul")


# bench's and predict's --workers: train's help speaks of its autotuner and --resume
SWEPT_WORKERS = {"workers": dict(help="N: parallel workers; a comma-separated list, one "
                                      "configuration each, or auto: every one that fits "
                                      "(default: 1 worker on all usable cores)")}


def build_parser():
    from .model.config import DEFAULT_MODEL, MODELS
    ap = _Parser(prog="starpu-llm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action=_Version,
                    help="this version, the StarPU it runs on and what the build has, then exit")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train GPT-2 (default: 124M on the bundled Shakespeare)")
    add_train_args(t)

    pr = sub.add_parser("prepare", help="tokenize a text file into llm.c train/val shards")
    pr.add_argument("text", nargs="?", type=_given("TEXT", optional=False),
                    help="UTF-8 text file (default: the bundled Shakespeare); <|endoftext|> "
                         "starts it and every paragraph after a blank line, each a document "
                         "(llm.c's tinyshakespeare convention)")
    pr.add_argument("--out-dir", default=".", type=_given("--out-dir"),
                    help="where the shards go (default: .)")
    from .io.data import VAL_TOKENS
    pr.add_argument("--val-tokens", type=_CHECKS["positive"]("--val-tokens"), default=VAL_TOKENS,
                    help="the text's first tokens that make the validation shard (default "
                         "%(default)s); the rest make the training shard")
    pr.add_argument("--shard-tokens", type=_CHECKS["positive"]("--shard-tokens"), default=None,
                    metavar="N", help="write the training tokens as shards of N (+1: each "
                                      "begins with the last one's last token) named "
                                      "<name>_train_000000.bin, ... as llm.c's data scripts "
                                      "do (100M tokens a shard); train on them with "
                                      "--train-data \"DIR/<name>_train_*.bin\" (default: one "
                                      "training shard, <name>_train.bin)")

    b = sub.add_parser("bench", help="tokens/ms of the engines (and PyTorch eager) side by side")
    b.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                   help="the model (default %(default)s)")
    batches = [1, 4, 8]
    b.add_argument("--batches", default=batches, type=_CHECKS["positive_list"]("--batches"),
                   help=f"comma-separated B values (default {_listed(batches)})")
    add_setting_args(b, train_settings_named("seq_len"))
    b.add_argument("--steps", type=_CHECKS["positive"]("--steps"), default=10,
                   help="timed steps (default %(default)s)")
    add_setting_args(b, partition_settings("workers", "cores_per_worker", "sub_batches", "kcore"),
                     sweep=True, overrides=SWEPT_WORKERS)
    b.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager reference")
    b.add_argument("--repeat", type=_CHECKS["positive"]("--repeat"), default=1,
                   help="runs of each configuration, interleaved round-robin; the median is "
                        "reported (default %(default)s)")
    b.add_argument("--csv", metavar="PATH", type=_given("--csv"),
                   help="also write the table as CSV")

    c = sub.add_parser("calibrate", help="measure this machine's cost model for `predict` "
                                         "(a few minutes; one file per machine)")
    from .perf.machine import default_path
    machine_file = default_path().replace("%", "%%")        # as argparse's help shows it
    c.add_argument("--out", metavar="PATH", type=_given("--out"),
                   help=f"where to write it (default: {machine_file}, this host's file in "
                        f"$STARPU_LLM_HOME or the user's cache)")
    from .perf.calibrate import QUICK_STEPS, STEPS
    c.add_argument("--steps", type=_CHECKS["positive"]("--steps"), default=None,
                   help=f"traced steps per calibration run, after one warm-up (default: "
                        f"{STEPS}; {QUICK_STEPS} with --quick)")
    c.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                   help="the model of the traced runs (default %(default)s, GPT-2 124M; "
                        "smaller ones only to test the calibration)")
    c.add_argument("--quick", action="store_true",
                   help="a cut-down calibration for a node lent for minutes: shorter rate "
                        "timings, two batch sizes, no full-length run (perf/calibrate.py)")

    pd = sub.add_parser("predict", help="predict tokens/ms of a configuration from the task "
                                        "graph and the calibrated cost model")
    pd.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                    help="the model (default %(default)s)")
    add_setting_args(pd, train_settings_named("batch", "seq_len"), overrides={"batch": dict(
        help="sequences per step (default %(default)s); with a list of --ranks, per rank (weak "
             "scaling, as the paper's Figure 4)")})
    ranks = [1]
    pd.add_argument("--ranks", type=_CHECKS["positive_list"]("--ranks"), default=ranks,
                    help=f"MPI processes, one per node (default {_listed(ranks)}); a "
                         f"comma-separated list predicts each (1,2,4,8,16: the paper's Figure "
                         f"4, tokens/ms per node)")
    add_setting_args(pd, partition_settings("workers", "cores_per_worker", "sub_batches",
                                            "ownership", "pipeline_stages"), sweep=True,
                     overrides=SWEPT_WORKERS)
    add_setting_args(pd, train_settings_named("memory_limit"), overrides={"memory_limit": dict(
        help="one process training under `train --memory-limit SIZE`: the disk traffic of "
             "StarPU's eviction and its time at the calibrated disk bandwidth are added")})
    pd.add_argument("--calibration", metavar="PATH", type=_given("--calibration"),
                    help=f"this machine's calibration file (default: {machine_file}, "
                         f"calibrate's)")
    pd.add_argument("--machine", metavar="FILE", type=_given("--machine"), help="predict for another machine described "
                                                      "in FILE (TOML: docs/perfmodel.md, \"What-if: the "
                                                      "paper's node\"; examples in the source's "
                                                      "experiments/machines/)")

    from .flow.generate import Generating
    g = sub.add_parser("generate", help="continue a prompt with a model of GPT-2's vocabulary, "
                                        "printing the text as it comes")
    g.add_argument("--init-from", required=True, metavar="MODEL",
                   type=_given("--init-from", optional=False), help=INIT_FROM_HELP)
    g.add_argument("--prompt", default="", help="text to continue (default: none, start from "
                                                "<|endoftext|>)")
    add_setting_args(g, fields(Generating))
    _model_run_args(g, "starpu: the task graph with a key/value cache; reference: the same "
                       "kernels in a plain loop")

    sv = sub.add_parser("serve", help="serve a model of GPT-2's vocabulary over HTTP with "
                                      "OpenAI's completions and chat API, batching the requests "
                                      "(docs/serving.md)")
    sv.add_argument("--init-from", required=True, metavar="MODEL",
                    type=_given("--init-from", optional=False), help=INIT_FROM_HELP)
    add_setting_args(sv, serving_settings("host", "port", "max_batch", "max_queue"))
    _model_run_args(sv, workers="; with N > 1 the slots are split into N groups that step "
                                "side by side")
    sv.add_argument("--model-name", type=_model_name, default=None, help="the model's name in the API (default: "
                                                       "the checkpoint's file name, without "
                                                       "its extension)")
    sv.add_argument("--chat-template", default=None, metavar="FILE", type=_given("--chat-template"),
                    help="Jinja2 chat template of /v1/chat/completions, as Hugging Face "
                         "tokenizers ship them (default: 'Role: content' lines ending in "
                         "'Assistant:', docs/serving.md)")
    add_setting_args(sv, serving_settings("shutdown_timeout", "stall_timeout", "log_level"))
    _serve_edge_args(sv)

    from .training.hellaswag import DEFAULT_ROWS
    ev = sub.add_parser("eval", help="HellaSwag's accuracy of a model of GPT-2's vocabulary: "
                                     "acc and acc_norm (docs/training.md)")
    ev.add_argument("--hellaswag", required=True, metavar="FILE",
                    type=_given("--hellaswag", optional=False),
                    help="HellaSwag's jsonl (hellaswag_val.jsonl: ctx, 4 endings, label a line)")
    ev.add_argument("--init-from", required=True, metavar="MODEL",
                    type=_given("--init-from", optional=False), help=INIT_FROM_HELP)
    ev.add_argument("--limit", type=_CHECKS["positive"]("--limit"), metavar="N",
                    help="only the first N examples (default: all)")
    ev.add_argument("--batch", type=_CHECKS["positive"]("--batch"), default=DEFAULT_ROWS,
                    metavar="B", help=f"rows (an example's 4 endings are 4 rows) a forward "
                                      f"(default {DEFAULT_ROWS})")
    _model_run_args(ev)

    cv = sub.add_parser("convert", help="convert a model between llm.c's checkpoint and a "
                                        "Hugging Face GPT-2 folder (transformers' "
                                        "save_pretrained)")
    cv.add_argument("src", metavar="SRC", type=_given("SRC", optional=False), help="an llm.c checkpoint, a Hugging Face GPT-2 "
                                               "folder, or a Hub model's name in the local cache")
    cv.add_argument("dst", metavar="DST", type=_given("DST", optional=False), help="a path ending in .bin: an llm.c checkpoint; "
                                               "else a Hugging Face folder (written whole)")
    return ap


def _model_run_args(p, engine: str = "starpu: the task graph; reference: the same kernels in a "
                                      "plain loop", workers: str = ""):
    """--engine (its help `engine`) and the partition flags of a command that runs a model
    read from a file (generate, serve, eval; decode_request reads them back); `workers`: what
    --workers' help adds."""
    from .plan.partition import ENGINES
    p.add_argument("--engine", default=ENGINES[0], choices=list(ENGINES), help=engine)
    add_setting_args(p, partition_settings(*DECODE_PARTITION),
                     overrides={"workers": dict(
                         type=_CHECKS["positive"]("--workers"),
                         help=f"N StarPU workers (default: 1, on all the cores){workers}")})


def _serve_edge_args(sv):
    """serve's access, timeout and size flags (serve/middleware.py): the key and the origins,
    then serve/settings.Edges' settings."""
    from .serve.settings import Edges     # a plain dataclass: no serve extra needed
    sv.add_argument("--api-key", type=_api_key, default=Edges.api_key,
                    help="clients must send 'Authorization: Bearer KEY' (HTTP 401 otherwise; "
                         "GET /health stays open); default: $STARPU_LLM_API_KEY, else no key")
    sv.add_argument("--allow-origin", action="append", default=list(Edges.allow_origins),
                    metavar="ORIGIN",
                    help="an origin (https://host[:port], or *) whose web pages may call the "
                         "server (CORS); a request from another origin (a browser's Origin "
                         "header) is refused with HTTP 403; repeatable; default: none")
    sv.add_argument("--allow-host", action="append", type=_host_flag,
                    default=list(Edges.allow_hosts), metavar="NAME",
                    help="a host name (or *) clients may reach the server by, beyond --host's "
                         "(and localhost on loopback; an IP address always): a request whose "
                         "Host header names another is refused with HTTP 400 (DNS rebinding); "
                         "repeatable; default: none, but any with --host 0.0.0.0 or ::")
    add_setting_args(sv, [f for f in fields(Edges) if "help" in f.metadata])


def _api_key(s, name="--api-key"):
    """serve --api-key (or $STARPU_LLM_API_KEY, name): serve/settings.check_api_key's rule."""
    from .serve.settings import check_api_key
    try:
        check_api_key(s, name)
    except StarpuLLMError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


def _host_flag(s):
    """serve --allow-host: a host name as a Host header gives it (lower case, no port), or *."""
    name = s.lower().rstrip(".")
    if name != "*" and not _HOST_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"--allow-host {s!r} is not a host name: give the name alone, as in --allow-host "
            f"myhost.lan (no scheme, port or path), or * for any")
    return name


INIT_FROM_HELP = ("the model: an llm.c fp32 checkpoint, a Hugging Face GPT-2 folder, or a Hub "
                  "model's name (gpt2) in the local Hugging Face cache")


def given_train_settings(argv) -> frozenset:
    """The train settings that argv (train's words, after the command) gives explicitly: a
    resumed run takes the others from its checkpoint (training/resume.py)."""
    p = _Parser(prog="starpu-llm train", add_help=False)
    add_setting_args(p, train_settings(), defaults=False)
    return frozenset(vars(p.parse_known_args(argv)[0]))


def cmd_train(args):
    from .training.trainer import TrainConfig, train
    result = train(TrainConfig(**{f.name: getattr(args, f.name) for f in train_settings()},
                               flags_given=given_train_settings(args.argv[1:])))
    if result.unwritten:     # the training is complete and saved; some outputs are missing
        print(f"starpu-llm: error: the run ended, but {len(result.unwritten)} of its outputs "
              f"were not written: " + "; ".join(result.unwritten), file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_prepare(args):
    import shlex
    from .training.checkpointing import Output, check_new_outputs, is_shard_file, is_tokenizer_file
    from .io import corpus, data, formats
    name = None if args.text else "shakespeare"
    sharded = args.shard_tokens is not None
    data.check_shard_tokens(args.shard_tokens)
    train, val, tokenizer = data.prepared_paths(args.text, args.out_dir, name, sharded)
    fix = "give another --out-dir"
    inputs = {"the text": args.text}
    check_new_outputs({"the validation shard": Output(val, is_shard_file, fix=fix),
                       "the tokenizer": Output(tokenizer, is_tokenizer_file, fix=fix)}
                      | ({} if sharded else
                         {"the training shard": Output(train, is_shard_file, fix=fix)}), inputs)
    # an earlier prepare's training shards: each replaced or removed
    for earlier in data.prepared_train_files(args.text, args.out_dir, name):
        check_new_outputs({"the training shard": Output(earlier, is_shard_file, fix=fix)}, inputs)
    source = args.text if args.text else corpus.shakespeare_text()
    train, val = data.prepare(source, args.out_dir, val_tokens=args.val_tokens, name=name,
                              shard_tokens=args.shard_tokens)
    if not sharded:
        print(f"wrote {train} and {val}")
        return 0
    shards = data.shard_paths(train)
    last = formats.read_shard(shards[-1]).size
    print(f"wrote {len(shards)} training shard(s) of {args.shard_tokens + 1:,} tokens (the last "
          f"{last:,}), {shards[0]} .. {os.path.basename(shards[-1])}, and {val}; train on them "
          f"with --train-data {shlex.quote(train)} --val-data {shlex.quote(val)}")
    return 0


def cmd_bench(args):
    from .bench import is_bench_table, run_bench
    from .training.checkpointing import Output, check_new_outputs
    if args.csv:                   # before minutes of runs
        check_new_outputs({"--csv": Output(args.csv, is_bench_table)}, {})
    run_bench(args)
    return 0


def cmd_calibrate(args):
    from .training.checkpointing import Output, check_new_outputs
    from .perf.calibrate import calibrate
    from .perf.machine import default_path, is_machine_file
    out = args.out or default_path()
    # before minutes of measuring; the default file, starpu-llm's own, is replaced whatever it is
    check_new_outputs({"--out": Output(out, is_machine_file if args.out else lambda p: True)}, {})
    calibrate(out, steps=args.steps, model=args.model, quick=args.quick)
    return 0


def cmd_predict(args):
    from .plan.partition import PartitionRequest
    from .perf.machine import load
    from .plan.partition import shapes
    from .perf.predict import calibration_for, layouts, predict, target_partition
    from .runtime.offload import parse_size
    machine = load(args.machine) if args.machine else None      # its errors name the file
    calibration, note = calibration_for(args.calibration, machine)
    target = machine or calibration
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    if args.workers == "auto":
        if args.cores_per_worker:
            raise StarpuLLMError("--workers auto takes every N x K of the machine's cores: "
                                 "leave --cores-per-worker out")
        found = [(n, k) for n, k in shapes(target.cores) if args.batch % n == 0]
    else:
        found = [(n, k) for n in args.workers or [None] for k in args.cores_per_worker or [None]]
    ranks_layouts = {R: layouts(R, args.ownership, args.pipeline_stages, args.model)
                     for R in args.ranks}
    for R, found_layouts in ranks_layouts.items():
        if not found_layouts:
            raise StarpuLLMError(
                f"--pipeline-stages {','.join(map(str, args.pipeline_stages))} with --ranks {R}: "
                f"no pipeline of "
                f"that many stages runs on {R} rank(s) (the stages must divide the ranks, at "
                f"most {args.model}'s layers + 1); give stages that divide {R}, or auto")
    weak = len(args.ranks) > 1        # --batch per rank; efficiency against one node
    print(f"machine: {target.name}")
    if note:
        print(note, file=sys.stderr)
    for shape in found:
        for subs in args.sub_batches or [None]:
            def at(R, layout):
                B = args.batch * R if weak else args.batch
                # a described machine runs K-core workers as StarPU 1.4 parallel workers (the
                # clusters'); this one as its build does
                p = target_partition(PartitionRequest(
                    workers=shape[0], cores_per_worker=shape[1], sub_batches=subs,
                    ownership=layout[0], pipeline_stages=layout[1]), R, B, target.cores,
                    True if machine else None)
                return predict(args.model, B, args.seq_len, p, calibration=calibration,
                               machine=machine, memory_limit=limit)
            one = at(1, layouts(1)[0]).tokens_per_ms if weak else None
            for R in args.ranks:
                ranked = sorted((at(R, layout) for layout in ranks_layouts[R]),
                                key=lambda p: -p.tokens_per_ms)
                for p in ranked:
                    per_node = (f" ({p.tokens_per_ms / R:.4f} tok/ms per node"
                                + (f", {p.tokens_per_ms / R / one:.0%} of one node's"
                                   if weak else "") + ")") if R > 1 else ""
                    print(p.describe() + per_node, flush=True)
    return 0


def decode_request(args):
    """The PartitionRequest of serve's and generate's partition flags."""
    from .plan.partition import PartitionRequest
    return PartitionRequest(**{name: getattr(args, name) for name in DECODE_PARTITION})


def cmd_generate(args):
    from .cli_generate import run_generate
    run_generate(args.init_from, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                 args.seed, args.engine, request=decode_request(args), top_p=args.top_p)
    return 0


def cmd_serve(args):
    from .cli_serve import run_serve
    request = decode_request(args)
    return run_serve(args.init_from, args.host, args.port, args.max_batch, args.max_queue,
                     args.engine, request, args.model_name, args.shutdown_timeout,
                     args.log_level, edges=_serve_edges(args), chat_template=args.chat_template,
                     stall_timeout=args.stall_timeout)


def _serve_edges(args) -> dict:
    """serve/middleware.Edges' fields, from the flags; the key from $STARPU_LLM_API_KEY
    without --api-key (a key on the command line is visible to every user in ps)."""
    key = args.api_key
    if key is None and os.environ.get("STARPU_LLM_API_KEY") is not None:
        try:
            key = _api_key(os.environ["STARPU_LLM_API_KEY"], "STARPU_LLM_API_KEY")
        except argparse.ArgumentTypeError as e:
            raise StarpuLLMError(f"{e} (or unset: no key)") from None
    from .serve.settings import Edges
    return dict(api_key=key, allow_origins=tuple(args.allow_origin),
                allow_hosts=tuple(args.allow_host),
                **{f.name: getattr(args, f.name) for f in fields(Edges) if "help" in f.metadata})


def cmd_eval(args):
    from .cli_generate import run_eval, tenths
    s = run_eval(args.init_from, args.hellaswag, args.limit, args.batch, args.engine,
                 decode_request(args), tenths("hellaswag"))
    print(f"hellaswag: {args.hellaswag}, {s.examples} example(s): {s.describe()}")
    return 0


def cmd_convert(args):
    from .training.checkpointing import convert
    print(f"wrote {convert(args.src, args.dst)}")
    return 0


COMMANDS = {"convert": cmd_convert, "train": cmd_train, "prepare": cmd_prepare, "bench": cmd_bench,
            "calibrate": cmd_calibrate, "predict": cmd_predict, "generate": cmd_generate,
            "serve": cmd_serve, "eval": cmd_eval}


def main(argv=None) -> int:
    with signals.guarded_output():   # a closed stdout or stderr stops as a signal does
        return _main(argv)


def _main(argv=None) -> int:
    job = {"comm": None, "stop": None}      # the MPI communicator, once MPI runs
    try:
        with signals.stop_on_signal() as job["stop"]:
            try:
                parser = build_parser()    # the compiled modules load before MPI (runtime/mpi.py)
            except ImportError as e:       # not from a signal: a library the build linked
                missing = compiled_part_missing(e)
                if missing is None or job["stop"].signum is not None:
                    raise
                raise StarpuLLMError(f"starpu-llm needs {missing}") from None
            from .runtime import mpi as distributed
            comm = job["comm"] = distributed.world()
            with distributed.phase(comm, "reading the command line"):
                args = parser.parse_args(argv)
                args.argv = list(sys.argv[1:] if argv is None else argv)
            return COMMANDS[args.cmd](args)
    except StarpuLLMError as e:
        return _failed(e, job["comm"], 2)
    except KeyboardInterrupt as e:       # signals.Interrupted, or Python's own
        signum = e.signum if isinstance(e, signals.Interrupted) else signal.SIGINT
        return _interrupted(signum, job["comm"], getattr(e, "agreed", False))
    except Exception as e:
        stop = job["stop"]
        if stop is not None and stop.signum is not None and _from_a_signal(e):
            return _interrupted(stop.signum, job["comm"], False)
        if job["comm"] is None:
            raise
        traceback.print_exc()
        return _end_job(job["comm"], 1, False)


def _from_a_signal(e: BaseException) -> bool:
    """Whether e is a signal's Interrupted that the code it landed in turned into another
    error: raised while handling it, or an ImportError (numpy's import makes one of it)."""
    while e is not None:
        if isinstance(e, (KeyboardInterrupt, ImportError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _interrupted(signum: int, comm, agreed: bool) -> int:
    """The end on a signal (or a closed output): one line, status 128 + its number."""
    sys.stdout.flush()
    if comm is None or not agreed or comm.Get_rank() == 0:     # an agreed stop: rank 0 says it
        signals.say(signals.ended(signum))      # on the stream that still works
    return _end_job(comm, 128 + signum, agreed)


def _failed(e: StarpuLLMError, comm, status: int) -> int:
    """Report e once (see the module) and end with status."""
    agreed = getattr(e, "agreed", False)
    if isinstance(e, UsageError):
        text = e.args[0]
    else:
        where = f"rank {comm.Get_rank()}: " if comm is not None and not agreed else ""
        text = f"starpu-llm: error: {where}{e.render(flag_of)}"
    quiet = False            # another rank's failure, said by rank 0 (only under MPI, whose
    if comm is not None:     # import needs the compiled part: an error may be that it is missing)
        from .runtime.mpi import PeerFailed
        quiet = isinstance(e, PeerFailed)
    if not quiet:
        print(text, file=sys.stderr, flush=True)
    return _end_job(comm, status, agreed)


def _end_job(comm, status: int, agreed: bool) -> int:
    """Under mpirun, an end that only this rank knows of ends every rank (MPI_Abort): the
    others may be waiting for it."""
    if comm is not None and not agreed:
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
