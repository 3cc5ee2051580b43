"""Hugging Face GPT-2 checkpoints (io/hf.py): random GPT2LMHeadModel's saved by transformers,
in the file layouts found in the wild, converted and run by both engines against transformers;
HF -> llm.c -> HF bitwise; a model trained from one and exported, loaded by transformers; the
tokenizer files; the refused configs and damaged files; --init-from with a Hub name in the
local cache (a cache laid out here: nothing is downloaded). The layouts transformers reads
but no longer writes (bf16 and fp16 weights, the tied pair saved as lm_head.weight alone) and
the written config's fields are tested on files made here, without transformers."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.numpy import load_file, save_file  # noqa: E402

from starpu_llm import cli  # noqa: E402
from starpu_llm.model.config import GPTConfig  # noqa: E402
from starpu_llm.errors import StarpuLLMError  # noqa: E402
from starpu_llm.flow import generate as gen  # noqa: E402
from starpu_llm.flow.engine import StarPUEngine  # noqa: E402
from starpu_llm.flow.reference import ReferenceEngine  # noqa: E402
from starpu_llm.io import formats, hf, tokenizer  # noqa: E402
from starpu_llm.model.state import TrainState, random_init  # noqa: E402
from starpu_llm.training.trainer import TrainConfig, train  # noqa: E402

from bounds import logits_bound  # noqa: E402

torch.set_num_threads(1)

# (n_positions, vocab_size, n_layer, n_head, n_embd): GPT-2's vocabulary (tokenizer files
# written) and two others (padded to a multiple of 128 in llm.c's layout; one already is)
CONFIGS = {"gpt2vocab": (16, 50257, 1, 2, 16), "v97": (32, 97, 2, 4, 32),
           "v256": (24, 256, 3, 3, 48)}
# how the weights are stored: save_pretrained's safetensors; pytorch_model.bin as older
# transformers wrote it (lm_head.weight and the attention-mask buffers included); the Hub's
# gpt2 layout (safetensors without the "transformer." prefix, with the buffers)
LAYOUTS = ("safetensors", "pytorch", "hub")


def needs_transformers():
    """transformers (the test extra), for the tests against it; the others run without it"""
    return pytest.importorskip("transformers")


def hf_model(name: str, seed: int = 0):
    transformers = needs_transformers()
    n_pos, V, L, NH, C = CONFIGS[name]
    config = transformers.GPT2Config(n_positions=n_pos, vocab_size=V, n_layer=L, n_head=NH,
                                     n_embd=C, bos_token_id=min(50256, V - 1),
                                     eos_token_id=min(50256, V - 1))
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():       # every parameter distinct, so a mixed-up tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save(model, folder, layout: str = "safetensors") -> str:
    folder = str(folder)
    if layout == "safetensors":
        model.save_pretrained(folder)
        return folder
    os.makedirs(folder, exist_ok=True)
    model.config.to_json_file(os.path.join(folder, hf.CONFIG))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = model.config.n_positions
    for l in range(model.config.n_layer):
        sd[f"transformer.h.{l}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        sd[f"transformer.h.{l}.attn.masked_bias"] = torch.tensor(-1e4)
    if layout == "pytorch":
        sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()
        torch.save(sd, os.path.join(folder, hf.PYTORCH))
    else:
        save_file({k[len("transformer."):]: v.numpy() for k, v in sd.items()
                   if k.startswith("transformer.")}, os.path.join(folder, hf.SAFETENSORS),
                  metadata={"format": "pt"})
    return folder


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.double().numpy()


def engine_logits(kind, config: GPTConfig, params, tokens, runtime) -> np.ndarray:
    """(B, T, V) logits of the engine `kind` for tokens (B, T)."""
    B, T = tokens.shape
    stream = np.concatenate([tokens.reshape(-1), [0]]).astype(np.uint16)
    state = TrainState(config=config, params=np.array(params))
    engine = (ReferenceEngine(config, state, B, T, stream) if kind == "reference"
              else StarPUEngine(config, state, B, T, stream, runtime=runtime))
    try:
        engine.forward_backward(0)
        if kind == "starpu":
            engine.sync()
        return engine.logits()[:, :, :config.V].astype(np.float64)
    finally:
        engine.close()


def tensors_of(folder) -> dict:
    return load_file(os.path.join(folder, hf.SAFETENSORS))


def error_of(*argv, capsys) -> str:
    """The one error line of `starpu-llm *argv`, which must fail cleanly."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


# --------------------------------------------------------------------------- in: the logits

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_converted_logits_within_bound(name, layout, tmp_path, runtime):
    model = hf_model(name)
    src = save(model, tmp_path / "hf", layout)
    assert cli.main(["convert", src, str(tmp_path / "model.bin")]) == 0
    config, params = formats.read_checkpoint(tmp_path / "model.bin")
    n_pos, V, L, NH, C = CONFIGS[name]
    assert (config.maxT, config.V, config.L, config.NH, config.C) == (n_pos, V, L, NH, C)
    assert config.Vp % 128 == 0 and config.Vp >= V
    B, T = 2, n_pos
    tokens = np.random.default_rng(1).integers(0, V, (B, T))
    want = torch_logits(model, tokens)
    bound = logits_bound(config, B, T, float(np.abs(want).max()))
    for kind in ("reference", "starpu"):
        got = engine_logits(kind, config, params, tokens, runtime)
        err = float(np.abs(got - want).max())
        assert err <= bound, f"{name}/{layout}/{kind}: max |logits - transformers'| = " \
                             f"{err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_llmc_hf_bitwise(layout, tmp_path):
    model = hf_model("v97", seed=3)
    src = save(model, tmp_path / "src", layout)
    assert cli.main(["convert", src, str(tmp_path / "m.bin")]) == 0
    assert cli.main(["convert", str(tmp_path / "m.bin"), str(tmp_path / "back")]) == 0
    back = tensors_of(tmp_path / "back")
    want = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(back) == sorted(want)
    for k, v in want.items():
        assert back[k].dtype == np.float32 and back[k].tobytes() == v.tobytes(), k
    cfg = json.loads((tmp_path / "back" / hf.CONFIG).read_text())
    for k in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd", "activation_function",
              "layer_norm_epsilon", "tie_word_embeddings", "model_type"):
        assert cfg[k] == getattr(model.config, k), k
    # and the llm.c file: the padded vocabulary rows are zero
    config, params = formats.read_checkpoint(tmp_path / "m.bin")
    wte = params[:config.Vp * config.C].reshape(config.Vp, config.C)
    assert not wte[config.V:].any() and wte[:config.V].tobytes() == want[
        "transformer.wte.weight"].tobytes()


# --------------------------------------------------------------------------- in: files made here

SMALL = GPTConfig(max_seq_len=8, vocab_size=97, padded_vocab_size=128, num_layers=2,
                  num_heads=2, channels=8)


def write_safetensors(path, tensors: dict) -> None:
    """A safetensors file written by hand (the package's numpy writer has no bfloat16):
    {name: (dtype tag, shape, little-endian bytes)} -> an 8-byte header size, the JSON header
    (padded to 8 bytes), the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for _, _, raw in tensors.values():
            f.write(raw)


def small_folder(path) -> str:
    """A folder with SMALL's config.json; the test writes the weights."""
    os.makedirs(path)
    with open(os.path.join(path, hf.CONFIG), "w") as f:
        json.dump(hf.hf_config(SMALL), f)
    return str(path)


def assert_reads_as(src, want: dict) -> None:
    """The folder src reads as SMALL with the fp32 tensors want (HF's names), bitwise."""
    config, params = hf.read_model(src)
    got = hf.hf_tensors(config, params)
    assert config == SMALL and sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_half_precision_weights_are_widened_exactly(dtype, tmp_path):
    """A folder saved in bf16 or fp16 (save_pretrained of a model in that dtype): each weight
    is read as the fp32 of its stored value, exactly. A bf16 is the upper 16 bits of a float32;
    numpy has no bfloat16, and such a file was refused as damaged."""
    fp32 = hf.hf_tensors(SMALL, random_init(SMALL, seed=4))
    stored, want = {}, {}
    for name, a in fp32.items():
        if dtype == "BF16":
            bits = a.view(np.uint32)
            stored[name] = (dtype, a.shape, (bits >> 16).astype("<u2").tobytes())
            want[name] = (bits & np.uint32(0xFFFF0000)).view(np.float32)
        else:
            stored[name] = (dtype, a.shape, a.astype("<f2").tobytes())
            want[name] = a.astype(np.float16).astype(np.float32)
    assert any(not np.array_equal(want[n], fp32[n]) for n in fp32)     # the rounding shows
    src = small_folder(tmp_path / "half")
    write_safetensors(os.path.join(src, hf.SAFETENSORS), stored)
    assert_reads_as(src, want)


def test_the_tied_pair_saved_as_the_head_alone(tmp_path):
    """safetensors' save_model keeps one name of a shared tensor, lm_head.weight for
    GPT2LMHeadModel's tied pair, and transformers loads such a file: it is read with wte =
    that tensor (it was refused as missing transformer.wte.weight)."""
    want = hf.hf_tensors(SMALL, random_init(SMALL, seed=5))
    stored = dict(want)
    stored["lm_head.weight"] = stored.pop("transformer.wte.weight")
    src = small_folder(tmp_path / "head")
    save_file(stored, os.path.join(src, hf.SAFETENSORS), metadata={"format": "pt"})
    assert_reads_as(src, want)


def test_written_config_has_what_other_readers_need(tmp_path):
    """config.json of a written folder: n_ctx beside n_positions (transformers ignores it;
    llama.cpp's convert_hf_to_gguf.py reads it as the context length), the vocabulary
    unpadded (97, not llm.c's 128), and the settings the engine computes."""
    out = hf.write_hf(tmp_path / "m", SMALL, random_init(SMALL))
    with open(os.path.join(out, hf.CONFIG)) as f:
        cfg = json.load(f)
    assert cfg["n_ctx"] == cfg["n_positions"] == 8 and cfg["vocab_size"] == 97
    assert (cfg["tie_word_embeddings"], cfg["activation_function"],
            cfg["layer_norm_epsilon"]) == (True, "gelu_new", 1e-5)
    assert hf.read_model(out)[0] == SMALL


# --------------------------------------------------------------------------- out: trained, exported

def test_train_from_hf_export_and_transformers_agree(tmp_path, runtime):
    """5 steps from a HF folder (--init-from), exported with --save-hf: transformers loads the
    folder (model and tokenizer), its logits are within the bound of ours and its greedy
    continuation is ours."""
    transformers = needs_transformers()
    model = hf_model("gpt2vocab", seed=5)
    src = save(model, tmp_path / "src")
    shard = str(tmp_path / "training.bin")
    formats.write_shard(shard, np.tile(np.random.default_rng(0).integers(0, 50257, 41),
                                       30).astype(np.uint16))
    out = str(tmp_path / "exported")
    result = train(TrainConfig(init_from=src, train_data=shard, batch=2, seq_len=16, steps=5,
                               lr=1e-3, save_hf=out, log=None), runtime=runtime)
    state = result.state
    assert state.step == 5
    trained = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "The king"
    ids = tokenizer.encode(prompt)
    assert tok.encode(prompt) == ids
    tokens = np.random.default_rng(2).integers(0, 50257, (2, 16))
    ours = engine_logits("reference", state.config, state.params, tokens, runtime)
    theirs = torch_logits(trained, tokens)
    bound = logits_bound(state.config, 2, 16, float(np.abs(ours).max()))
    assert float(np.abs(ours - theirs).max()) <= bound
    # the same greedy continuation (a near-tie within the bound may break either way)
    n = 16 - len(ids)
    with torch.no_grad():
        cont = trained.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                pad_token_id=tokenizer.EOT_ID)[0, len(ids):].tolist()
    config, params = hf.read_model(out)            # as generate and serve read it
    backend = gen.DirectBackend(config, params)
    try:
        mine = gen.generate(gen.Decoder(backend), ids, n, temperature=0.0)
    finally:
        backend.close()
    assert cli.main(["generate", "--init-from", out, "--prompt", prompt, "--max-new-tokens",
                     "2", "--engine", "reference"]) == 0
    if mine != cont:
        i = next(k for k, (a, b) in enumerate(zip(mine, cont)) if a != b)
        last = torch_logits(trained, np.array([ids + cont[:i]]))[0, -1]
        top2 = np.sort(last)[-2:]
        assert top2[1] - top2[0] <= 2 * bound, (mine, cont)


def test_exported_tokenizer_encodes_as_ours(tmp_path):
    """vocab.json + merges.txt reproduce GPT-2's BPE: transformers' tokenizer of the written
    folder gives our ids on text with spaces, newlines, unicode and <|endoftext|>."""
    transformers = needs_transformers()
    config = GPTConfig(max_seq_len=8, vocab_size=50257, padded_vocab_size=50304, num_layers=1,
                       num_heads=1, channels=4)
    out = hf.write_hf(tmp_path / "m", config, np.zeros(config.num_parameters, np.float32))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n<|endoftext|>"
            "  gazed at the café — naïve 日本語 🙂 it's 1,234.5%\t tabs\r\n")
    assert tok.encode(text) == tokenizer.encode(text)
    assert tok.decode(tokenizer.encode(text)) == text
    assert tok.eos_token_id == tokenizer.EOT_ID


# --------------------------------------------------------------------------- refused configs

REFUSED = {"model_type": "gpt_neo", "activation_function": "relu",
           "scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True,
           "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "n_inner": 100,
           "scale_attn_weights": False, "add_cross_attention": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(hf_model("v97"), tmp_path_factory.mktemp("saved") / "hf")


def copy_of(saved, tmp_path) -> str:
    return str(shutil.copytree(saved, tmp_path / "copy"))


@pytest.mark.parametrize("setting", sorted(REFUSED))
def test_refused_config(setting, saved, tmp_path, capsys):
    src = copy_of(saved, tmp_path)
    path = os.path.join(src, hf.CONFIG)
    with open(path) as f:
        cfg = json.load(f)
    cfg[setting] = REFUSED[setting]
    with open(path, "w") as f:
        json.dump(cfg, f)
    dst = tmp_path / "out.bin"
    err = error_of("convert", src, str(dst), capsys=capsys)
    assert setting in err and path in err, err
    assert not dst.exists()


def _edit_tensors(src, edit):
    path = os.path.join(src, hf.SAFETENSORS)
    t = load_file(path)
    edit(t)
    save_file(t, path, metadata={"format": "pt"})
    return path


DAMAGE = {
    "missing tensor": (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"),
                       ["transformer.h.1.mlp.c_fc.bias"]),
    "wrong shape": (lambda t: t.update({"transformer.h.0.attn.c_attn.weight":
                                        np.zeros((96, 32), np.float32)}),
                    ["transformer.h.0.attn.c_attn.weight", "(96, 32)", "(32, 96)"]),
    "untied head": (lambda t: t.update({"lm_head.weight": np.ones((97, 32), np.float32)}),
                    ["lm_head.weight", "tied"]),
    "unknown tensor": (lambda t: t.update({"transformer.h.2.ln_1.weight":
                                           np.ones(32, np.float32)}),
                       ["transformer.h.2.ln_1.weight"]),
    "NaN": (lambda t: t["transformer.wpe.weight"].__setitem__((0, 0), np.nan), ["wpe"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_tensors(damage, saved, tmp_path, capsys):
    src = copy_of(saved, tmp_path)
    edit, needles = DAMAGE[damage]
    path = _edit_tensors(src, edit)
    err = error_of("convert", src, str(tmp_path / "out.bin"), capsys=capsys)
    for n in [path] + needles:
        assert n in err, err


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no weights", "no config",
                                    "bad json", "pytorch truncated"])
def test_damaged_files(damage, saved, tmp_path, capsys):
    src = copy_of(saved, tmp_path)
    st = os.path.join(src, hf.SAFETENSORS)
    named = st
    if damage == "truncated":
        with open(st, "r+b") as f:
            f.truncate(os.path.getsize(st) // 2)
    elif damage == "garbage":
        with open(st, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    elif damage == "no weights":
        os.unlink(st)
        named = src
    elif damage == "no config":
        os.unlink(os.path.join(src, hf.CONFIG))
        named = src
    elif damage == "bad json":
        named = os.path.join(src, hf.CONFIG)
        with open(named, "w") as f:
            f.write("{\"model_type\": \"gpt2\",")
    else:
        os.unlink(st)
        model = hf_model("v97")
        named = os.path.join(save(model, tmp_path / "pt", "pytorch"), hf.PYTORCH)
        with open(named, "r+b") as f:
            f.truncate(os.path.getsize(named) - 100)
        src = str(tmp_path / "pt")
    err = error_of("convert", src, str(tmp_path / "out.bin"), capsys=capsys)
    assert named in err, err


def test_pytorch_file_without_torch(tmp_path, monkeypatch, capsys):
    src = save(hf_model("v97"), tmp_path / "pt", "pytorch")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)     # import torch fails
    err = error_of("convert", src, str(tmp_path / "out.bin"), capsys=capsys)
    assert os.path.join(src, hf.PYTORCH) in err and "install torch" in err, err


# --------------------------------------------------------------------------- outputs

def test_convert_refuses_to_overwrite(saved, tmp_path, capsys):
    src = copy_of(saved, tmp_path)
    before = sorted(os.listdir(src))
    assert "overwrite" in error_of("convert", src, src, capsys=capsys)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("mine")
    assert "thesis.tex" in error_of("convert", src, str(other), capsys=capsys)
    text = tmp_path / "text.bin"
    text.write_text("not a checkpoint")
    assert str(text) in error_of("convert", src, str(text), capsys=capsys)
    assert text.read_text() == "not a checkpoint" and (other / "thesis.tex").exists()
    assert sorted(os.listdir(src)) == before
    # a folder written before is replaced whole, nothing left beside it
    assert cli.main(["convert", src, str(tmp_path / "out")]) == 0
    assert cli.main(["convert", src, str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        set(hf.WRITTEN) - set(hf.TOKENIZER_FILES))
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_write_hf_from_python_never_replaces_other_files(tmp_path):
    """hf.write_hf called from Python (no command's check before it) onto a folder holding
    other files, or onto a file: one StarpuLLMError naming them, nothing touched (the folder
    was moved aside and removed with everything in it); a folder it wrote is replaced."""
    from starpu_llm.model.config import MODELS
    config = MODELS["tiny"]
    params = random_init(config)
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(StarpuLLMError, match=r"the folder .*project holds files that are not "
                                             r"a GPT-2 model's \(notes.txt\)"):
        hf.write_hf(mine, config, params)
    text = tmp_path / "text"
    text.write_text("mine")
    with pytest.raises(StarpuLLMError, match="is a file"):
        hf.write_hf(text, config, params, "DST")
    assert (mine / "notes.txt").read_text() == "mine" and text.read_text() == "mine"
    out = tmp_path / "out"
    for _ in range(2):
        hf.write_hf(out, config, params)
    np.testing.assert_array_equal(hf.read_model(out)[1][:config.num_parameters],
                                  params[:config.num_parameters])
    assert sorted(os.listdir(tmp_path)) == ["out", "project", "text"]


def test_train_save_hf_checked_before_training(saved, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    err = error_of("train", "--init-from", saved, "--steps", "1", "--save-hf", str(other),
                   capsys=capsys)
    assert "--save-hf" in err and "a.txt" in err and "step" not in capsys.readouterr().out


def test_train_save_hf_over_the_checkpoint_dir_is_refused(saved, tmp_path, capsys):
    """--save-hf replaces its folder whole at the end: a --checkpoint-dir that is that folder
    or inside it (its checkpoints would go with it) is refused before training."""
    shard = str(tmp_path / "training.bin")
    formats.write_shard(shard, np.arange(200, dtype=np.uint16) % 97)
    for ck in ("out", os.path.join("out", "ck")):
        err = error_of("train", "--init-from", saved, "--train-data", shard, "--steps", "1",
                       "--batch", "1", "--seq-len", "8", "--engine", "reference",
                       "--save-hf", str(tmp_path / "out"), "--save-every", "1",
                       "--checkpoint-dir", str(tmp_path / ck), capsys=capsys)
        assert "--save-hf" in err and "--checkpoint-dir" in err, err
        assert not (tmp_path / "out").exists()          # nothing trained, nothing written


def test_train_save_hf_needs_safetensors_before_training(saved, tmp_path, capsys, monkeypatch):
    """Without the safetensors package --save-hf is refused before the first step, not after
    the training."""
    llmc = str(tmp_path / "model.bin")
    assert cli.main(["convert", saved, llmc]) == 0
    shard = str(tmp_path / "training.bin")
    formats.write_shard(shard, np.arange(200, dtype=np.uint16) % 97)
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)    # import fails
    err = error_of("train", "--init-from", llmc, "--train-data", shard, "--steps", "1",
                   "--batch", "1", "--seq-len", "8", "--engine", "reference", "--save-hf",
                   str(tmp_path / "out"), "--metrics-jsonl", str(tmp_path / "m.jsonl"),
                   capsys=capsys)
    assert "--save-hf" in err and "safetensors" in err, err
    assert not (tmp_path / "m.jsonl").exists()          # not a step trained


def test_train_save_hf_failing_at_the_end_keeps_the_model(saved, tmp_path, monkeypatch):
    """--save-hf's folder cannot be written after the training after all (its parent
    replaced by a file during the run): the model goes to --save's fallback file in the
    working directory, named in the error, as a failed --save's does."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()

    def log(line):
        if line.startswith("step") and out.is_dir():
            out.rmdir()
            out.write_text("")

    shard = str(tmp_path / "training.bin")
    formats.write_shard(shard, np.arange(200, dtype=np.uint16) % 97)
    with pytest.raises(StarpuLLMError, match="written to (.*starpu-llm-unsaved-.*-step1.bin)") as e:
        train(TrainConfig(init_from=saved, train_data=shard, steps=1, batch=1, seq_len=8,
                          engine="reference", save_hf=str(out / "hf"), log=log))
    fallback = e.value.args[0].split("written to ")[1].split(" ")[0]
    assert formats.read_checkpoint(fallback)[0].num_layers > 0


def _full_disk_in_safetensors(monkeypatch):
    """safetensors' writer failing as on a full disk: its own error, not an OSError"""
    import safetensors.numpy
    from safetensors import SafetensorError

    def save_file(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)


def _full_disk_in_json(monkeypatch):
    """the folder's JSON files failing as on a full disk"""
    def _json(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(hf, "_json", _json)


@pytest.mark.parametrize("fill", [_full_disk_in_safetensors, _full_disk_in_json],
                         ids=["safetensors", "json"])
def test_a_full_disk_under_save_hf_keeps_the_model(saved, tmp_path, monkeypatch, fill):
    """The disk fills while --save-hf's folder is written (no --save): one error naming the
    folder and the fallback file the model went to, no temporary folder left behind."""
    monkeypatch.chdir(tmp_path)
    fill(monkeypatch)
    shard = str(tmp_path / "training.bin")
    formats.write_shard(shard, np.arange(200, dtype=np.uint16) % 97)
    with pytest.raises(StarpuLLMError, match="No space left on device.*written to "
                                             "(.*starpu-llm-unsaved-.*-step1.bin)") as e:
        train(TrainConfig(init_from=saved, train_data=shard, steps=1, batch=1, seq_len=8,
                          engine="reference", save_hf=str(tmp_path / "hf"), log=None))
    assert str(tmp_path / "hf") in e.value.args[0]
    fallback = e.value.args[0].split("written to ")[1].split(" ")[0]
    assert formats.read_checkpoint(fallback)[0].num_layers > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []


def test_a_written_folder_has_the_umasks_modes(saved, tmp_path):
    """Every file of a written folder readable as the umask allows (safetensors alone would
    leave model.safetensors 0600)."""
    old = os.umask(0o022)
    try:
        hf.write_hf(tmp_path / "hf", *hf.read_model(saved))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


# --------------------------------------------------------------------------- --init-from a Hub name

@contextlib.contextmanager
def hub_cache(root):
    """huggingface_hub's cache at root (its lookup reads constants.HF_HUB_CACHE)."""
    from huggingface_hub import constants
    old = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(root)
    try:
        yield
    finally:
        constants.HF_HUB_CACHE = old


def test_init_from_hub_name(saved, tmp_path, capsys):
    with hub_cache(tmp_path / "hub"):
        err = error_of("generate", "--init-from", "gpt2", "--max-new-tokens", "1",
                       capsys=capsys)
        assert "gpt2" in err and "hf download gpt2" in err and str(tmp_path / "hub") in err
        # the layout huggingface_hub writes: refs/main names the snapshot
        repo = tmp_path / "hub" / "models--gpt2"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0123abcd")
        shutil.copytree(saved, repo / "snapshots" / "0123abcd")
        c1, p1 = hf.read_model("gpt2")
        c2, p2 = hf.read_model(saved)
        assert c1 == c2 and p1.tobytes() == p2.tobytes()


def test_one_reader_for_every_init_from(monkeypatch, saved, tmp_path, capsys):
    """train, generate and serve all read --init-from through hf.read_model."""
    seen = []

    def spy(source, lazy=False):
        seen.append(source)
        raise StarpuLLMError(f"spied {source}")
    monkeypatch.setattr(hf, "read_model", spy)
    for argv in (["train", "--steps", "1"], ["generate"], ["serve", "--port", "0"]):
        error_of(*argv, "--init-from", "X", capsys=capsys)
    assert seen == ["X"] * 3
