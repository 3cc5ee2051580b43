"""Serving many generation requests: tokens/s and latency of four ways to answer them (issue
35, item 6; docs/serving.md).

The workload: --requests requests (default 64), each a prompt of --prompt-tokens GPT-2 tokens
(default 32; windows of the bundled Shakespeare, decoded to text, kept when they encode back
to exactly that many tokens) continued greedily by --new-tokens tokens (default 64), sent by a
closed loop of C clients (a client sends its next request when its last one is answered), for
each concurrency C of --concurrency (default 1,4,16). The model: GPT-2 124M (d12) with
random weights (random_init, seed 1337; no pretrained weights here), written once as an llm.c
checkpoint that every system reads. The systems:

  a  one `starpu-llm generate` process per request (the create-destroy baseline: Python,
     StarPU, the checkpoint, the registration, for every request)
  b  `starpu-llm serve --max-batch 1` (one request at a time, the model loaded once)
  c  `starpu-llm serve --max-batch 16` (continuous batching)
  d  Hugging Face transformers' batched generate on PyTorch CPU with the same weights, the C
     prompts of a round as one batch (what a user would pick); a benchmark baseline only,
     installed by `make serving-bench` (pip install transformers into the venv)

Each request's start, end and generated tokens go to requests.csv; summary.csv has, per
system and concurrency, the generated tokens per second of wall time, the p50 and p95 request
latency and the load average before and after; serving.png plots tokens/s against
concurrency. The systems take turns at each concurrency (a, b, c, d, then the next C), so a
change of the machine's load falls on all of them alike. Other processes on the machine skew
every number: the load average is recorded beside each.

    make serving-bench                                  # all of it (about 40 minutes here)
    .venv/bin/python experiments/serving_bench.py --systems b,c --concurrency 16
    .venv/bin/python experiments/serving_bench.py --model tiny --requests 8 --out /tmp/sb
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from provenance import cpu_kind, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "serving")
FIGURE = os.path.join(os.path.dirname(HERE), "docs", "figures", "serving.png")
STARPU_LLM = [sys.executable, "-m", "starpu_llm"]
SYSTEMS = {"a": "generate per request", "b": "serve --max-batch 1",
           "c": "serve --max-batch 16", "d": "transformers generate"}


def prompts(n: int, length: int) -> list[str]:
    """n texts of exactly `length` GPT-2 tokens, from the bundled corpus."""
    from starpu_llm.io import data, formats, tokenizer
    tok = tokenizer.gpt2()
    ids = formats.read_shard(data.default_dataset()[1])        # the validation shard
    out, i = [], 0
    while len(out) < n:
        text = tok.decode(ids[i:i + length].tolist())
        if len(tok.encode(text)) == length:
            out.append(text)
        i += 97
    return out


def checkpoint(model: str, path: str):
    from starpu_llm.config import MODELS
    from starpu_llm.io import formats
    from starpu_llm.state import random_init
    formats.write_checkpoint(path, MODELS[model], random_init(MODELS[model], 1337))


def closed_loop(concurrency: int, texts, send) -> list[dict]:
    """Requests for every text from `concurrency` clients, each sending its next when the last
    is answered: [{request, start_s, end_s, tokens}] (times from the start of the loop)."""
    todo = list(enumerate(texts))
    lock = threading.Lock()
    t0 = time.perf_counter()
    rows = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i, text = todo.pop(0)
            start = time.perf_counter() - t0
            tokens = send(text)
            rows.append({"request": i, "start_s": start, "end_s": time.perf_counter() - t0,
                         "tokens": tokens})

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return sorted(rows, key=lambda r: r["request"])


# ---- a: one process per request

def run_generate_per_request(ckpt, texts, concurrency, new):
    def send(text):
        p = subprocess.run(STARPU_LLM + ["generate", "--init-from", ckpt, "--prompt", text,
                                         "--max-new-tokens", str(new), "--top-k", "1"],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"generate failed: {p.stderr}")
        return new
    return closed_loop(concurrency, texts, send)


# ---- b, c: the server

class Serve:
    def __init__(self, ckpt, max_batch, log):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(STARPU_LLM + ["serve", "--init-from", ckpt, "--port", "0",
                                                   "--max-batch", str(max_batch),
                                                   "--max-queue", "256", "--log-level",
                                                   "warning"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line}; see {log}")
        self.url, self.model = m.group(1), line.split()[1]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(300)
        self.log.close()


def run_server(ckpt, texts, concurrency, new, max_batch, log):
    import httpx
    server = Serve(ckpt, max_batch, log)
    try:
        with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=64)) as http:
            def send(text):
                r = http.post(server.url + "/v1/completions",
                              json={"model": server.model, "prompt": text, "max_tokens": new,
                                    "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]
            send(texts[0])                    # warm-up (first-touch pages, perf models)
            return closed_loop(concurrency, texts, send)
    finally:
        server.stop()


# ---- d: transformers

def hf_worker(ckpt, texts_json, concurrency, new, out_json):
    """In a process of its own: GPT-2 of transformers with the checkpoint's weights, the
    texts generated in batches of `concurrency` (greedy, exactly `new` tokens)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from starpu_llm.config import ParamLayout
    from starpu_llm.io import formats, tokenizer
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    config, params = formats.read_checkpoint(ckpt)
    w = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ParamLayout(config).views(params).items()}
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=config.V, n_positions=config.maxT,
                                    n_embd=config.C, n_layer=config.L, n_head=config.NH,
                                    activation_function="gelu_new", layer_norm_epsilon=1e-5))
    sd = {"transformer.wte.weight": w["wte"][:config.V], "transformer.wpe.weight": w["wpe"],
          "transformer.ln_f.weight": w["lnfw"], "transformer.ln_f.bias": w["lnfb"]}
    for l in range(config.L):
        h = f"transformer.h.{l}."
        # transformers' Conv1D computes x @ W: our (out, in) weights transposed
        sd.update({h + "ln_1.weight": w["ln1w"][l], h + "ln_1.bias": w["ln1b"][l],
                   h + "attn.c_attn.weight": w["qkvw"][l].T, h + "attn.c_attn.bias": w["qkvb"][l],
                   h + "attn.c_proj.weight": w["attprojw"][l].T,
                   h + "attn.c_proj.bias": w["attprojb"][l],
                   h + "ln_2.weight": w["ln2w"][l], h + "ln_2.bias": w["ln2b"][l],
                   h + "mlp.c_fc.weight": w["fcw"][l].T, h + "mlp.c_fc.bias": w["fcb"][l],
                   h + "mlp.c_proj.weight": w["fcprojw"][l].T,
                   h + "mlp.c_proj.bias": w["fcprojb"][l]})
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in sd.items()},
                                             strict=False)
    assert not unexpected and all(k == "lm_head.weight" or "attn.bias" in k or
                                  "masked_bias" in k for k in missing), (missing, unexpected)
    hf.tie_weights()
    hf.eval()
    tok = tokenizer.gpt2()
    texts = json.load(open(texts_json))
    ids = [tok.encode(t) for t in texts]
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        # the same model: the first prompt's next-token logits against the reference engine's
        from starpu_llm.flow.generate import Decoder, DirectBackend
        ours = Decoder(DirectBackend(config, params)).feed([ids[0]])[0]
        theirs = hf(torch.tensor([ids[0]])).logits[0, -1].double().numpy()
        check = float(np.abs(theirs - ours).max() / np.abs(ours).max())
        t0 = time.perf_counter()
        for b in range(0, len(ids), concurrency):
            batch = torch.tensor(ids[b:b + concurrency])
            start = time.perf_counter() - t0
            out = hf.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.eot)
            end = time.perf_counter() - t0
            for k in range(len(batch)):
                rows.append({"request": b + k, "start_s": start, "end_s": end,
                             "tokens": int(out.shape[1] - batch.shape[1])})
    json.dump({"rows": rows, "logits_rel_diff": check}, open(out_json, "w"))


def run_transformers(ckpt, texts, concurrency, new, tmp):
    tj, oj = os.path.join(tmp, "texts.json"), os.path.join(tmp, "hf.json")
    json.dump(texts, open(tj, "w"))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--hf-worker", ckpt, tj,
                        str(concurrency), str(new), oj], capture_output=True, text=True,
                       timeout=7200)
    if p.returncode != 0:
        raise RuntimeError(f"the transformers run failed: {p.stderr[-3000:]}")
    out = json.load(open(oj))
    # the same weights: their logits agree with ours to fp32 rounding
    if not out["logits_rel_diff"] < 1e-4:
        raise RuntimeError(f"transformers' logits differ from ours by {out['logits_rel_diff']:.2e}"
                           " of their largest: not the same model")
    return out["rows"]


# ---- the whole benchmark

def summary(rows, wall):
    lat = sorted(r["end_s"] - r["start_s"] for r in rows)
    return {"tokens_per_s": sum(r["tokens"] for r in rows) / wall,
            "p50_s": statistics.median(lat), "p95_s": float(np.percentile(lat, 95)),
            "wall_s": wall, "requests": len(rows)}


def plot(summaries, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in sorted({r["system"] for r in summaries}):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in summaries if r["system"] == s)
        ax.plot(*zip(*pts), marker="o", label=f"({s}) {SYSTEMS[s]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    cs = sorted({r["concurrency"] for r in summaries})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-worker":
        return hf_worker(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="a,b,c,d")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--requests-a", type=int, default=None,
                    help="requests of system a (default --requests): one process each, "
                         "oversubscribed at high concurrency, it is by far the slowest")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default="d12")
    ap.add_argument("--out", default=None, help="default: experiments/results/serving/<cpu>")
    ap.add_argument("--figure", default=FIGURE, help="where the plot goes too ('' : nowhere)")
    ap.add_argument("--plot-from", nargs="+", metavar="DIR",
                    help="only plot: the summary.csv of these runs together (into --figure)")
    args = ap.parse_args()
    if args.plot_from:
        rows = []
        for d in args.plot_from:
            with open(os.path.join(d, "summary.csv")) as f:
                rows += [{**r, "concurrency": int(r["concurrency"]),
                          "tokens_per_s": float(r["tokens_per_s"])} for r in csv.DictReader(f)]
        info = json.load(open(os.path.join(args.plot_from[0], "machine.json")))
        plot(rows, args.figure, f"GPT-2 {info['model']}, prompts of {info['prompt_tokens']} + "
             f"{info['new_tokens']} tokens; {info['cpu_model']}, {info['cores']} cores, "
             f"{info['commit']}")
        return
    systems = args.systems.split(",")
    if "d" in systems:
        try:
            import transformers  # noqa: F401
        except ImportError:
            sys.exit("system d needs transformers: make serving-bench installs it (or "
                     ".venv/bin/pip install transformers); or leave d out of --systems")
    out = args.out or os.path.join(RESULTS, cpu_kind())
    os.makedirs(out, exist_ok=True)
    texts = prompts(args.requests, args.prompt_tokens)
    tmp = tempfile.mkdtemp(prefix="serving-bench-")
    ckpt = os.path.join(tmp, f"{args.model}.bin")
    checkpoint(args.model, ckpt)
    info = machine_info()
    json.dump({**info, "model": args.model, "requests": args.requests,
               "requests_a": args.requests_a or args.requests,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
              open(os.path.join(out, "machine.json"), "w"), indent=1)
    all_rows, summaries = [], []
    try:
        for c in map(int, args.concurrency.split(",")):
            for s in systems:
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                if s == "a":
                    rows = run_generate_per_request(ckpt, texts[:args.requests_a], c,
                                                    args.new_tokens)
                elif s in "bc":
                    rows = run_server(ckpt, texts, c, args.new_tokens, 1 if s == "b" else 16,
                                      os.path.join(out, f"server-{s}-c{c}.log"))
                else:
                    rows = run_transformers(ckpt, texts, c, args.new_tokens, tmp)
                # the loop's own wall time: from the first request's start to the last's end
                wall = max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows)
                row = {"system": s, "concurrency": c, **summary(rows, wall),
                       "load_before": load, "load_after": os.getloadavg()[0]}
                summaries.append(row)
                all_rows += [{"system": s, "concurrency": c, **r} for r in rows]
                print(f"({s}) {SYSTEMS[s]:<22} C={c:<3} {row['tokens_per_s']:8.1f} tok/s  "
                      f"p50 {row['p50_s']:7.2f} s  p95 {row['p95_s']:7.2f} s  (load "
                      f"{load:.2f} -> {row['load_after']:.2f}; {time.perf_counter() - t0:.0f} s)",
                      flush=True)
                write(out, all_rows, summaries)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    title = (f"GPT-2 {args.model}, {args.requests} requests of {args.prompt_tokens} + "
             f"{args.new_tokens} tokens; {info['cpu_model']}, {info['cores']} cores, "
             f"{info['commit']}")
    plot(summaries, os.path.join(out, "serving.png"), title)
    if args.figure:
        shutil.copy(os.path.join(out, "serving.png"), args.figure)


def write(out, rows, summaries):
    for name, data in (("requests.csv", rows), ("summary.csv", summaries)):
        with open(os.path.join(out, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)


if __name__ == "__main__":
    main()
