"""starpu-llm and Hugging Face transformers on the same GPT-2 folders, as a transformers user
meets them: a random GPT2LMHeadModel saved by save_pretrained, fine-tuned with `starpu-llm
train --init-from FOLDER --save-hf OUT` and loaded back with GPT2LMHeadModel.from_pretrained
(its config fields, dtype, tied head, tokenizer, generation config); its logits against the
reference engine's on the same tokens (within tests/bounds.py's fp32 bound) and its greedy
model.generate against `starpu-llm generate --temperature 0`; then every weight layout found
in the wild read by `starpu-llm convert` (save_pretrained's safetensors, its shards, fp16 and
bf16 weights, pytorch_model.bin with lm_head and the attention-mask buffers, the Hub's names
without "transformer.", safetensors' save_model keeping only lm_head.weight) against the
weights transformers loads from the same folder. Not a test: it needs transformers and torch,
which the suite's own tests of these layouts (tests/test_hf.py) do not.

    .venv/bin/python experiments/hf_roundtrip.py > experiments/results/hf/roundtrip.log

Every check prints one line, PASS or FAIL; the exit status is the number of FAILs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import save_file as torch_save_file, save_model

from starpu_llm.flow.reference import ReferenceEngine
from starpu_llm.io import formats, hf, tokenizer
from starpu_llm.model.state import TrainState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bounds import logits_bound  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
CLI = [sys.executable, "-m", "starpu_llm"]
# (n_positions, vocab_size, n_layer, n_head, n_embd): GPT-2's vocabulary, so that the
# tokenizer files are written and generation reads text
SHAPE = dict(n_positions=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 40
failures = 0
work = "WORK"           # the temporary folder, shown as WORK in the log


def check(ok: bool, what: str, detail: str = "") -> None:
    global failures
    failures += not ok
    detail = detail.replace(work, "WORK")
    print(f"{'PASS' if ok else 'FAIL'}  {what}" + (f": {detail}" if detail else ""), flush=True)


def run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in argv], capture_output=True, text=True)


def random_model(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).eval()
    with torch.no_grad():       # every parameter distinct, so a mixed-up tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def reference_logits(folder_or_file, tokens) -> np.ndarray:
    """(B, T, V) logits of starpu-llm's reference engine on tokens (B, T)."""
    config, params = hf.read_model(folder_or_file)
    B, T = tokens.shape
    stream = np.concatenate([tokens.reshape(-1), [0]]).astype(np.uint16)
    engine = ReferenceEngine(config, TrainState(config=config, params=np.array(params)), B, T,
                             stream)
    try:
        engine.forward_backward(0)
        return engine.logits()[:, :, :config.V].astype(np.float64)
    finally:
        engine.close()


def compare_logits(model, source, what: str) -> None:
    config, _ = hf.read_model(source)
    tokens = np.random.default_rng(1).integers(0, config.V, (2, config.maxT))
    with torch.no_grad():
        theirs = model.float()(torch.from_numpy(tokens)).logits.double().numpy()
    ours = reference_logits(source, tokens)
    err = float(np.abs(ours - theirs).max())
    bound = logits_bound(config, 2, config.maxT, float(np.abs(theirs).max()))
    check(err <= bound, what, f"max |logits - transformers'| = {err:.2e}, fp32 bound {bound:.2e}")


def fine_tune(work: str) -> None:
    print("== fine-tune: save_pretrained -> starpu-llm train --init-from --save-hf -> "
          "from_pretrained")
    src = os.path.join(work, "src")
    random_model(seed=5).save_pretrained(src)
    with open(os.path.join(work, "text.txt"), "w") as f:
        f.write(TEXT)
    p = run("prepare", os.path.join(work, "text.txt"), "--out-dir", work, "--val-tokens", 256)
    check(p.returncode == 0, "starpu-llm prepare", p.stderr.strip()[-200:])
    out, ckpt = os.path.join(work, "ft-hf"), os.path.join(work, "ft.bin")
    p = run("train", "--init-from", src, "--train-data", os.path.join(work, "text_train.bin"),
            "--batch", 2, "--seq-len", 32, "--steps", 4, "--lr", 1e-3, "--save", ckpt,
            "--save-hf", out)
    check(p.returncode == 0, "starpu-llm train --init-from <save_pretrained folder> --save-hf",
          (p.stdout + p.stderr).strip().splitlines()[-1])

    print("-- the folder")
    files = sorted(os.listdir(out))
    check({"config.json", "generation_config.json", "model.safetensors", "vocab.json",
           "merges.txt", "tokenizer_config.json"} <= set(files), "files", ", ".join(files))
    with open(os.path.join(out, hf.CONFIG)) as f:
        raw = json.load(f)
    want = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "n_positions": SHAPE["n_positions"], "n_ctx": SHAPE["n_positions"],
            "vocab_size": 50257, "n_layer": 2, "n_head": 2, "n_embd": 32,
            "tie_word_embeddings": True, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256}
    for k, v in want.items():
        check(raw.get(k) == v, f"config.json {k}", f"{raw.get(k)!r} (want {v!r})")
    with open(os.path.join(out, hf.SAFETENSORS), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    check(dtypes == {"F32"}, "model.safetensors dtypes", str(sorted(dtypes)))
    check(header["transformer.wte.weight"]["shape"] == [50257, 32],
          "wte rows: the vocabulary (50257), not llm.c's padded 50304",
          str(header["transformer.wte.weight"]["shape"]))
    check("lm_head.weight" not in header, "no lm_head.weight (tied, as save_pretrained writes)")

    print("-- transformers loads it")
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    auto = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    check(type(auto).__name__ == "GPT2LMHeadModel", "AutoModelForCausalLM class",
          type(auto).__name__)
    check(model.dtype == torch.float32, "dtype", str(model.dtype))
    check(model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(),
          "lm_head tied to wte")
    check(model.config.vocab_size == 50257 and model.config.n_positions == 64,
          "GPT2Config vocab_size, n_positions",
          f"{model.config.vocab_size}, {model.config.n_positions}")
    gen_cfg = transformers.GenerationConfig.from_pretrained(out)
    check(gen_cfg.eos_token_id == 50256 and gen_cfg.bos_token_id == 50256,
          "generation_config.json", f"bos {gen_cfg.bos_token_id}, eos {gen_cfg.eos_token_id}")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    check(tok.encode(TEXT[:200]) == tokenizer.encode(TEXT[:200]), "AutoTokenizer ids = ours",
          type(tok).__name__)
    c1, p1 = hf.read_model(out)
    c2, p2 = formats.read_checkpoint(ckpt)
    check(c1 == c2 and np.asarray(p1).tobytes() == np.asarray(p2).tobytes(),
          "--save-hf and --save hold the same weights (bitwise)")
    compare_logits(model, out, "logits: transformers (from_pretrained) vs reference engine")

    print("-- greedy generation")
    prompt, n = "First Citizen:", 24
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        cont = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              pad_token_id=50256)[0, len(ids):].tolist()
    for engine in ("reference", "starpu"):
        p = run("generate", "--init-from", out, "--prompt", prompt, "--max-new-tokens", n,
                "--temperature", 0, "--engine", engine)
        theirs = tokenizer.decode(cont)
        check(p.returncode == 0 and theirs in p.stdout,
              f"model.generate (greedy) = starpu-llm generate --temperature 0 --engine {engine}",
              f"{theirs!r}" + ("" if theirs in p.stdout else f" vs {p.stdout!r} {p.stderr!r}"))


def layouts(work: str) -> None:
    print("== weight layouts in: starpu-llm convert FOLDER model.bin, against transformers")
    model = random_model(seed=7)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = SHAPE["n_positions"]

    def folder(name):
        path = os.path.join(work, name)
        os.makedirs(path, exist_ok=True)
        model.config.to_json_file(os.path.join(path, hf.CONFIG))
        return path

    made = {}
    made["save_pretrained safetensors"] = os.path.join(work, "st")
    model.save_pretrained(made["save_pretrained safetensors"])
    made["save_pretrained shards (model.safetensors.index.json)"] = os.path.join(work, "shards")
    model.save_pretrained(made["save_pretrained shards (model.safetensors.index.json)"],
                          max_shard_size="1MB")
    for dt in (torch.float16, torch.bfloat16):
        made[f"save_pretrained {dt}"] = os.path.join(work, str(dt))
        random_model(seed=7).to(dt).save_pretrained(made[f"save_pretrained {dt}"])
    buffers = {}
    for l in range(SHAPE["n_layer"]):
        buffers[f"transformer.h.{l}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        buffers[f"transformer.h.{l}.attn.masked_bias"] = torch.tensor(-1e4)
    made["pytorch_model.bin (lm_head + attn.bias/masked_bias)"] = p = folder("pt")
    torch.save({**sd, **buffers}, os.path.join(p, hf.PYTORCH))
    made["Hub names (no transformer., with the buffers)"] = p = folder("hub")
    torch_save_file({k[len("transformer."):]: v.contiguous()
                     for k, v in {**sd, **buffers}.items() if k.startswith("transformer.")},
                    os.path.join(p, hf.SAFETENSORS), metadata={"format": "pt"})
    made["lm_head.weight and wte both present"] = p = folder("both")
    torch_save_file({k: v.contiguous() for k, v in sd.items()},
                    os.path.join(p, hf.SAFETENSORS), metadata={"format": "pt"})
    made["safetensors save_model (lm_head.weight, no wte)"] = p = folder("head-only")
    save_model(model, os.path.join(p, hf.SAFETENSORS))

    for what, path in made.items():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
        dst = os.path.join(work, os.path.basename(path) + ".bin")
        p = run("convert", path, dst)
        if p.returncode:
            check(False, what, p.stderr.strip())
            continue
        config, params = formats.read_checkpoint(dst)
        back = hf.hf_tensors(config, params)
        want = {k: v.float().numpy() for k, v in theirs.state_dict().items()
                if k in back}
        same = sorted(want) == sorted(back) and all(
            back[k].tobytes() == want[k].tobytes() for k in want)
        check(same, f"{what}: weights = transformers' (fp32, bitwise)")
        compare_logits(theirs, dst, f"{what}: logits")

    print("== refused: a head that is not tied")
    p = folder("untied")
    torch_save_file({**{k: v.contiguous() for k, v in sd.items()},
                     "lm_head.weight": torch.ones_like(sd["lm_head.weight"])},
                    os.path.join(p, hf.SAFETENSORS), metadata={"format": "pt"})
    r = run("convert", p, os.path.join(work, "untied.bin"))
    check(r.returncode == 2 and "tied" in r.stderr and "Traceback" not in r.stderr,
          "untied lm_head.weight: one error", r.stderr.strip())


def main() -> int:
    global work
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="hf-roundtrip-") as work:
        fine_tune(work)
        layouts(work)
    print(f"{failures} FAIL")
    return failures


if __name__ == "__main__":
    sys.exit(main())
