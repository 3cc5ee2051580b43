"""Hugging Face GPT-2 checkpoints: the folder transformers' save_pretrained writes, read and
written (convert, --init-from, train --save-hf), and the one reader every --init-from goes
through (read_model: an llm.c checkpoint, such a folder, or a Hub name in the local cache).

A folder holds config.json and the weights: model.safetensors (read and written with the
safetensors package's numpy API: no torch), its shards (model.safetensors.index.json), or
pytorch_model.bin (read with torch.load(weights_only=True)). Between the two layouts:

- names: transformer.h.<l>.attn.c_attn.weight ... or, as the Hub's gpt2 has them, without
  "transformer."; the stacked (L, ...) tensors of llm.c are the L layers' tensors;
- Conv1D: HF GPT-2's c_attn, c_proj and c_fc weights are stored (in, out), llm.c's (out, in):
  transposed both ways;
- the vocabulary: HF's wte has V rows, llm.c's Vp (V rounded up to a multiple of 128, the
  extra rows 0): padded on reading, cut on writing;
- the head is tied to wte: an lm_head.weight, when the file has one, must equal wte; a file
  holding the pair once, as lm_head.weight alone (safetensors' save_model), gives wte;
- the dtype: fp16 and bf16 weights (numpy has no bfloat16: read from the file's bytes) are
  widened to fp32, exactly; the model is trained and written in fp32;
- attn.bias and attn.masked_bias (the causal mask buffers older files carry) are not weights:
  skipped.

A config this engine computes differently (another model_type, activation, attention scaling,
layer-norm epsilon, an untied head, a cross-attention, n_inner other than 4C) is refused,
naming the setting. Written folders (write_hf) also get GPT-2's tokenizer files (vocab.json
and merges.txt: OpenAI's encoder.json and vocab.bpe, the offline vocabulary of io/tokenizer.py)
when the model has GPT-2's vocabulary, so that AutoTokenizer loads them too. A folder is
written under a temporary name beside it and renamed into place."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import tempfile

import numpy as np

from . import atomic, formats, tokenizer
from ..model.config import GPTConfig, ParamLayout
from ..errors import StarpuLLMError

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH = "pytorch_model.bin"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json")
# what write_hf puts in a folder, and the other files of a GPT-2 folder it may replace
WRITTEN = (CONFIG, "generation_config.json", SAFETENSORS) + TOKENIZER_FILES
REPLACEABLE = WRITTEN + (PYTORCH, SAFETENSORS_INDEX, "tokenizer.json", "added_tokens.json")
VOCAB_ALIGN = 128        # llm.c pads V to a multiple of 128 (50257 -> 50304)

FETCH = ("on a machine with internet access: `hf download {name} config.json model.safetensors` "
         "(huggingface_hub >= 1.0; older: `huggingface-cli download ...`), or python -c "
         "\"from huggingface_hub import snapshot_download; snapshot_download('{name}', "
         "allow_patterns=['config.json', 'model.safetensors'])\"; then copy its cache "
         "(~/.cache/huggingface, or $HF_HOME) here")

# llm.c's block tensors: (the name within h.<l>., stored as Conv1D (in, out))
_BLOCK = {"ln1w": ("ln_1.weight", False), "ln1b": ("ln_1.bias", False),
          "qkvw": ("attn.c_attn.weight", True), "qkvb": ("attn.c_attn.bias", False),
          "attprojw": ("attn.c_proj.weight", True), "attprojb": ("attn.c_proj.bias", False),
          "ln2w": ("ln_2.weight", False), "ln2b": ("ln_2.bias", False),
          "fcw": ("mlp.c_fc.weight", True), "fcb": ("mlp.c_fc.bias", False),
          "fcprojw": ("mlp.c_proj.weight", True), "fcprojb": ("mlp.c_proj.bias", False)}
_TOP = {"wte": "wte.weight", "wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}
_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


# --------------------------------------------------------------------------- the config

def padded_vocab(V: int) -> int:
    return -(-V // VOCAB_ALIGN) * VOCAB_ALIGN


def config_of(hf: dict, path: str) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json's contents; one StarpuLLMError naming the setting
    this engine cannot run."""
    def refuse(setting, why):
        raise StarpuLLMError(f"{path}: {setting} = {json.dumps(hf.get(setting))}: {why}; this "
                             f"engine runs GPT-2 as OpenAI trained it, so convert only such a model")
    if hf.get("model_type") != "gpt2":
        refuse("model_type", "not a GPT-2 model (model_type \"gpt2\")")
    fixed = {"activation_function": ("gelu_new", "the engine's GeLU is the tanh form, gelu_new"),
             "layer_norm_epsilon": (1e-5, "the engine's layer norms use epsilon 1e-5"),
             "scale_attn_weights": (True, "the engine scales the attention by 1/sqrt(head size)"),
             "scale_attn_by_inverse_layer_idx": (False, "the engine does not scale the attention "
                                                        "by the layer index"),
             "reorder_and_upcast_attn": (False, "the engine computes the attention in one order"),
             "tie_word_embeddings": (True, "the engine's head is tied to the token embedding"),
             "add_cross_attention": (False, "the engine has no cross-attention")}
    defaults = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
                "add_cross_attention": False}
    for setting, (want, why) in fixed.items():
        if hf.get(setting, defaults[setting]) != want:
            refuse(setting, why)
    dims = {}
    for k in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd"):
        v = hf.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v < 2 ** 31:
            raise StarpuLLMError(f"{path}: {k} = {json.dumps(v)}: give a whole number in "
                                 f"1..{2 ** 31 - 1}")
        dims[k] = v
    C = dims["n_embd"]
    if hf.get("n_inner") not in (None, 4 * C):
        refuse("n_inner", f"the engine's MLP has 4 n_embd = {4 * C} hidden units")
    if C % dims["n_head"]:
        refuse("n_head", f"n_embd = {C} is not a multiple of it")
    return GPTConfig(max_seq_len=dims["n_positions"], vocab_size=dims["vocab_size"],
                     padded_vocab_size=padded_vocab(dims["vocab_size"]),
                     num_layers=dims["n_layer"], num_heads=dims["n_head"], channels=C)


def hf_config(config: GPTConfig) -> dict:
    """config.json of a model: GPT2LMHeadModel with the settings the engine computes."""
    eot = tokenizer.EOT_ID if config.V == tokenizer.N_VOCAB else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "activation_function": "gelu_new", "add_cross_attention": False,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
            "bos_token_id": eot, "eos_token_id": eot, "initializer_range": 0.02,
            "layer_norm_epsilon": 1e-5, "n_embd": config.C, "n_head": config.NH,
            "n_inner": None, "n_layer": config.L, "n_positions": config.maxT,
            # n_ctx: transformers ignores it, but the Hub's gpt2 configs have it and llama.cpp's
            # convert_hf_to_gguf.py reads it as the context length
            "n_ctx": config.maxT,
            "reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False,
            "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
            "vocab_size": config.V, "dtype": "float32"}


# --------------------------------------------------------------------------- reading

def is_hf_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def read_hf(path) -> tuple[GPTConfig, np.ndarray]:
    """(config, flat float32 parameters in llm.c's layout) of a Hugging Face GPT-2 folder."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG)
    f, _ = formats.open_regular(cfg_path, "config")
    with f:
        try:
            hf = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise StarpuLLMError(f"{cfg_path} is not valid JSON ({e}); re-create the folder "
                                 f"with save_pretrained") from None
    if not isinstance(hf, dict):
        raise StarpuLLMError(f"{cfg_path} is not a JSON object; re-create the folder with "
                             f"save_pretrained")
    config = config_of(hf, cfg_path)
    tensors, source = _read_weights(path)
    return config, _to_llmc(config, tensors, source)


def _read_weights(path: str):
    """({name: array}, a reader of them, the file(s) named in errors) of a folder."""
    st, index, pt = (os.path.join(path, n) for n in (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH))
    if os.path.exists(st):
        return _safetensors(st), st
    if os.path.exists(index):
        return _sharded(index), index
    if os.path.exists(pt):
        return _pytorch(pt), pt
    raise StarpuLLMError(f"{path} has a {CONFIG} but no weights ({SAFETENSORS}, "
                         f"{SAFETENSORS_INDEX} or {PYTORCH}); copy them in, or save the model "
                         f"again with save_pretrained")


def _safetensors_api():
    try:
        from safetensors import safe_open
    except ImportError:
        raise StarpuLLMError("reading or writing a Hugging Face folder needs the safetensors "
                             "package: pip install 'starpu-llm[hf]'") from None
    return safe_open


def _safetensors(file: str) -> dict:
    safe_open = _safetensors_api()
    formats.open_regular(file, "safetensors")[0].close()
    out, bf16 = {}, []
    try:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype() == "BF16":
                    bf16.append(name)
                else:
                    out[name] = (file, f.get_tensor(name))
        out.update((name, (file, a)) for name, a in _widened_bf16(file, bf16).items())
    except StarpuLLMError:
        raise
    except Exception as e:     # the package's SafetensorError and the dtypes numpy lacks
        raise StarpuLLMError(f"{file} cannot be read as safetensors ({e}); it is damaged or "
                             f"incomplete: download or save it again") from None
    return out


def _widened_bf16(file: str, names: list) -> dict:
    """{name: float32 array} of the BF16 tensors `names` of a safetensors file safe_open has
    checked: a bfloat16 is the upper half of a float32, so widening it is exact."""
    out = {}
    if not names:
        return out
    with open(file, "rb") as f:
        # the format: an 8-byte little-endian header size, the JSON header, the data
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        for name in names:
            begin, end = header[name]["data_offsets"]
            f.seek(8 + n + begin)
            half = np.frombuffer(f.read(end - begin), "<u2")
            out[name] = (half.astype(np.uint32) << 16).view(np.float32).reshape(
                header[name]["shape"])
    return out


def _sharded(index: str) -> dict:
    f, _ = formats.open_regular(index, "safetensors index")
    with f:
        try:
            shards = sorted(set(json.loads(f.read().decode("utf-8"))["weight_map"].values()))
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise StarpuLLMError(f"{index} is not a safetensors index (a JSON weight_map): "
                                 f"{e!r}; download or save it again") from None
    out = {}
    for shard in shards:
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise StarpuLLMError(f"{index} names a shard {shard!r} outside its folder")
        out.update(_safetensors(os.path.join(os.path.dirname(index), shard)))
    return out


def _pytorch(file: str) -> dict:
    try:
        import torch
    except ImportError:
        raise StarpuLLMError(f"{file} is PyTorch's format, which only torch reads: install torch, "
                             f"or convert the folder to {SAFETENSORS} where torch is (transformers'"
                             f" save_pretrained writes it)") from None
    formats.open_regular(file, "pytorch_model.bin")[0].close()
    try:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:     # zip, pickle, or torch's own errors: a damaged file
        raise StarpuLLMError(f"{file} cannot be read as a PyTorch state dict ({type(e).__name__}:"
                             f" {e}); it is damaged or incomplete: download or save it again") \
            from None
    if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
        raise StarpuLLMError(f"{file} does not hold a state dict (names to tensors); save the "
                             f"model again with save_pretrained")
    out = {}
    for name, t in sd.items():
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        out[name] = (file, t.numpy())
    return out


def _to_llmc(config: GPTConfig, tensors: dict, source: str) -> np.ndarray:
    """The llm.c buffer of a state dict ({name: (file, array)}): every tensor's name and shape
    checked against the config before the buffer is made (its size is the config's)."""
    prefix = "transformer." if any(n.startswith("transformer.") for n in tensors) else ""
    layout = ParamLayout(config)
    used, parts = set(), []          # (llm.c tensor, layer or None, array in llm.c's layout)
    head = "lm_head.weight"
    if prefix + _TOP["wte"] not in tensors and head in tensors:
        # the tied pair saved once, under the head's name (safetensors' save_model keeps one
        # name of a shared tensor): it is wte, and the check below finds it equal to itself
        tensors = {**tensors, prefix + _TOP["wte"]: tensors[head]}

    def take(name, shape, transposed=False):
        full = prefix + name
        if full not in tensors:
            raise StarpuLLMError(f"{source} has no tensor {full}, which GPT-2 with "
                                 f"n_layer = {config.L} needs: the file is incomplete or not of "
                                 f"this config; download or save it again")
        file, a = tensors[full]
        used.add(full)
        want = shape[::-1] if transposed else shape
        if tuple(a.shape) != tuple(want):
            raise StarpuLLMError(f"{file}: tensor {full} has shape {tuple(a.shape)}, its config "
                                 f"says {tuple(want)}; the weights do not belong to this "
                                 f"{CONFIG}")
        if a.dtype.kind != "f":
            raise StarpuLLMError(f"{file}: tensor {full} is of type {a.dtype}, not floating "
                                 f"point; save the model again with save_pretrained")
        return a.T if transposed else a

    for name, hf_name in _TOP.items():
        shape = layout.shapes[name]
        rows = config.V if name == "wte" else shape[0]
        parts.append((name, None, take(hf_name, (rows,) + shape[1:])))
    for l in range(config.L):
        for name, (hf_name, conv) in _BLOCK.items():
            parts.append((name, l, take(f"h.{l}.{hf_name}", layout.shapes[name][1:], conv)))
    if head in tensors:
        file, a = tensors[head]
        used.add(head)
        wte = parts[0][2]
        if a.shape != wte.shape or not np.array_equal(a, wte):
            raise StarpuLLMError(f"{file}: tensor {head} differs from the token embedding "
                                 f"{prefix}wte.weight: the head is not tied, and this engine's "
                                 f"is; convert only a model with a tied head")
    for name in tensors:
        if name not in used and not _BUFFERS.fullmatch(name[len(prefix):]):
            raise StarpuLLMError(f"{tensors[name][0]} holds tensor {name}, which GPT-2 of this "
                                 f"config does not have; convert only GPT2LMHeadModel's weights")
    flat = np.zeros(layout.total, np.float32)         # wte's rows V..Vp stay 0
    views = layout.views(flat)
    for name, l, a in parts:
        if l is None:
            views[name][:len(a)] = a
        else:
            views[name][l] = a
    if not np.isfinite(flat).all():
        bad = next(n for n, v in views.items() if not np.isfinite(v).all())
        raise StarpuLLMError(f"{source}: tensor {bad} holds NaN or infinite values; the "
                             f"weights are damaged")
    return flat


# --------------------------------------------------------------------------- --init-from

def hub_dir(name: str) -> str:
    """The folder of the Hub model `name` (gpt2, openai-community/gpt2-medium) in the local
    Hugging Face cache; nothing is downloaded. One error naming the model and how to fetch it
    when it is not there."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise StarpuLLMError(f"{name} is not a file or folder here, and finding it in the "
                             f"Hugging Face cache needs huggingface_hub: pip install "
                             f"'starpu-llm[hf]', or give the model's folder") from None
    try:
        found = try_to_load_from_cache(name, CONFIG)
    except Exception:        # a name the Hub's rules refuse (huggingface_hub's validation)
        found = None
    if isinstance(found, str):
        folder = os.path.dirname(found)
        if any(os.path.exists(os.path.join(folder, w))
               for w in (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH)):
            return folder
    raise StarpuLLMError(f"{name} is not a file or folder here, and the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}) has no copy of the model {name} with its "
                         f"weights; fetch it {FETCH.format(name=name)}")


def read_model(source, lazy: bool = False):
    """(config, parameters) of what an --init-from names: an llm.c checkpoint (lazy: its
    parameters stay in the file, formats.read_checkpoint), a Hugging Face GPT-2 folder, or the
    name of a Hub model in the local cache (hub_dir)."""
    source = os.fspath(source)
    if os.path.isdir(source):
        if not is_hf_dir(source):
            raise StarpuLLMError(f"{source} is a folder without a {CONFIG}: give an llm.c "
                                 f"checkpoint file or a Hugging Face GPT-2 folder")
        return read_hf(source)
    if not os.path.lexists(source) and _HUB_NAME.fullmatch(source) and \
            not source.endswith(".bin"):
        return read_hf(hub_dir(source))
    return formats.read_checkpoint(source, lazy)


# --------------------------------------------------------------------------- writing

def hf_tensors(config: GPTConfig, flat) -> dict:
    """{name: float32 array} of GPT2LMHeadModel's state dict (no lm_head: tied) of an llm.c
    buffer (a numpy array or a state.Slices)."""
    flat = materialize(config, flat)
    views = ParamLayout(config).views(flat)
    out = {}
    for name, hf_name in _TOP.items():
        v = views[name][:config.V] if name == "wte" else views[name]
        out["transformer." + hf_name] = np.ascontiguousarray(v)
    for l in range(config.L):
        for name, (hf_name, conv) in _BLOCK.items():
            v = views[name][l]
            out[f"transformer.h.{l}.{hf_name}"] = np.ascontiguousarray(v.T if conv else v)
    return out


def materialize(config: GPTConfig, flat) -> np.ndarray:
    """A ParamLayout buffer as one float32 numpy array (a state.Slices read whole)."""
    if isinstance(flat, np.ndarray):
        return np.ascontiguousarray(flat.reshape(-1), dtype=np.float32)
    from ..model.state import read_slice_into
    out = np.empty(ParamLayout(config).total, np.float32)
    for _, offset, shape in ParamLayout(config).slice_list():
        read_slice_into(flat, offset, out[offset:offset + math.prod(shape)])
    return out


def write_hf(path, config: GPTConfig, flat, what: str = "the folder") -> str:
    """The Hugging Face GPT-2 folder of a model at path (config.json, model.safetensors, and
    the tokenizer files for GPT-2's vocabulary), written beside it under a temporary name and
    renamed onto it; a folder there is replaced whole, so one holding anything but a model's
    files, or a file, is refused (what: how the error names path)."""
    _safetensors_api()
    _check_replaceable(os.fspath(path), what)
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path.rstrip(os.sep))
    prefix = f".{base}.{socket.gethostname()}.{os.getpid()}."
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    except OSError as e:
        raise StarpuLLMError(f"cannot write {path}: {e.strerror}; choose a writable output "
                             f"location") from e
    try:
        tensors = hf_tensors(config, flat)
        # a full disk: OSError, or the package's SafetensorError ("I/O error: No space left")
        try:
            save_file(tensors, os.path.join(tmp, SAFETENSORS), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:
            raise atomic._write_error(os.path.join(path, SAFETENSORS), e) from e
        try:
            _json(tmp, CONFIG, hf_config(config))
            eot = tokenizer.EOT_ID if config.V == tokenizer.N_VOCAB else None
            _json(tmp, "generation_config.json", {"bos_token_id": eot, "eos_token_id": eot})
            if config.V == tokenizer.N_VOCAB:
                _tokenizer_files(tmp, config)
            for name in os.listdir(tmp):    # every file as the umask says (safetensors: 0600)
                os.chmod(os.path.join(tmp, name), 0o644 & ~atomic._umask())
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
        except OSError as e:
            raise atomic._write_error(path, e) from e
        os.chmod(tmp, 0o755 & ~atomic._umask())
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _json(folder: str, name: str, obj) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _tokenizer_files(folder: str, config: GPTConfig) -> None:
    """GPT-2's tokenizer as transformers' GPT2Tokenizer reads it: vocab.json and merges.txt are
    OpenAI's encoder.json and vocab.bpe (the same files; checked by their sha256)."""
    encoder, merges = tokenizer.vocabulary_files()
    shutil.copyfile(encoder, os.path.join(folder, "vocab.json"))
    shutil.copyfile(merges, os.path.join(folder, "merges.txt"))
    eot = tokenizer.EOT_TEXT
    _json(folder, "tokenizer_config.json",
          {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.maxT,
           "bos_token": eot, "eos_token": eot, "unk_token": eot, "add_prefix_space": False,
           "add_bos_token": False})
    _json(folder, "special_tokens_map.json", {"bos_token": eot, "eos_token": eot,
                                              "unk_token": eot})


def _swap_in(tmp: str, path: str) -> None:
    """Rename the complete folder tmp onto path; a folder at path is moved aside first and
    removed once the new one is in place."""
    old = None
    try:
        if os.path.lexists(path):
            old = tmp[:-len(".tmp")] + ".old"
            os.rename(path, old)
        os.rename(tmp, path)
    except OSError as e:
        if old is not None and not os.path.lexists(path) and os.path.lexists(old):
            os.rename(old, path)
        raise atomic._write_error(path, e) from e
    atomic._fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_hf_output(path, what: str) -> None:
    """Refuse now a folder write_hf could not write or would lose data by replacing: a file, a
    folder holding anything but a GPT-2 model's files (what = the flag or argument named), or
    one that this Python cannot write (no safetensors package)."""
    try:
        _safetensors_api()
    except StarpuLLMError as e:
        raise StarpuLLMError(f"{what} {path}: {e}") from None
    path = os.fspath(path)
    _check_replaceable(path, what)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    probe = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}.probe")
    atomic.check_writable(probe)


def _check_replaceable(path: str, what: str) -> None:
    """Nothing at path, or a folder of a GPT-2 model's files only: what write_hf may replace
    whole without losing data."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StarpuLLMError(f"{what} {path} is a file; give a folder (a Hugging Face model "
                             f"folder is written there)")
    if os.path.isdir(path):
        other = sorted(set(os.listdir(path)) - set(REPLACEABLE))
        if other:
            shown = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
            raise StarpuLLMError(f"{what} {path} holds files that are not a GPT-2 model's "
                                 f"({shown}), and the folder is replaced as a whole; give an "
                                 f"empty or new folder, or one written by --save-hf")
