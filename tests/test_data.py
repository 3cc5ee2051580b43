"""The Shakespeare corpus, prepare(), default_dataset() caching and the DataLoader."""
import errno
import os

import numpy as np
import pytest

from starpu_llm.io import corpus, data, formats
from starpu_llm.io.corpus import shakespeare_text
from starpu_llm.io.data import DataLoader, default_dataset, prepare
from starpu_llm.errors import StarpuLLMError, flag
from starpu_llm.io.tokenizer import decode, encode


@pytest.fixture(autouse=True)
def _cache_env(tmp_path, monkeypatch):
    # never write to $HOME's cache from the tests
    monkeypatch.setenv("STARPU_LLM_CACHE", str(tmp_path / "cache"))


SMALL = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
         "All:\nSpeak, speak.\n\n"
         "First Citizen:\nYou are all resolved rather to die than to famish?\n")


# --------------------------------------------------------------------------- corpus

def test_shakespeare_text():
    s = shakespeare_text()
    assert len(s) >= 1_100_000
    first = s.split("\n\n", 1)[0].split("\n")
    assert first[0] == "THESEUS:" and first[1].startswith("Now, fair Hippolyta")
    blocks = s.rstrip("\n").split("\n\n")
    assert len(blocks) > 8000
    assert all(b.split("\n", 1)[0].endswith(":") and "\n" in b for b in blocks)
    for junk in ("**", "_Exit", "_Enter", "\\-", "\\[", "# ACT", "\n\n\n"):
        assert junk not in s, junk
    assert shakespeare_text() is s          # cached


def test_play_blocks_markdown():
    md = ("# A Play\n\n## ACT I\n\n### SCENE I. A place.\n\n_Enter A and\nB_\n\n"
          "**A**  \nHello there,  \nfriend\\--no.\n\n_Exit B_\n\nStill A. __\\[Aside]_  \n\n"
          "**B**  \n[Within]_  \nWho's there?\n\n*Sound a horn.*\n\nA PLAY\n\n**C**  \n_Dies_\n")
    assert corpus.play_blocks(md) == ["A:\nHello there,\nfriend--no.\nStill A.", "B:\nWho's there?"]


# --------------------------------------------------------------------------- prepare

def test_prepare_small_text(tmp_path):
    src = tmp_path / "small.txt"
    src.write_text(SMALL, encoding="utf-8")
    train, val = prepare(src, tmp_path / "out", val_tokens=5)
    assert train == str(tmp_path / "out" / "small_train.bin")
    assert val == str(tmp_path / "out" / "small_val.bin")
    assert (tmp_path / "out" / "gpt2_tokenizer.bin").is_file()
    expected = encode("<|endoftext|>" + SMALL.replace("\n\n", "\n\n<|endoftext|>"))
    assert expected[0] == 50256 and expected.count(50256) == 3
    v, t = formats.read_shard(val, 50257), formats.read_shard(train, 50257)
    assert v.tolist() == expected[:5] and t.tolist() == expected[5:]
    tok = formats.read_tokenizer(tmp_path / "out" / "gpt2_tokenizer.bin")
    assert tok.decode(np.concatenate([v, t])) == decode(expected)
    # a file written on Windows (CRLF): the same tokens (its blank lines start documents too)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(SMALL.replace("\n", "\r\n").encode())
    v, t = (formats.read_shard(p, 50257) for p in prepare(crlf, tmp_path / "out", val_tokens=5)[::-1])
    assert v.tolist() + t.tolist() == expected
    # the text itself (a str with newlines) and an explicit name
    train2, _ = prepare(SMALL, tmp_path / "out", val_tokens=5, name="inline")
    assert os.path.basename(train2) == "inline_train.bin"
    assert formats.read_shard(train2).tolist() == expected[5:]


def test_prepare_bad_inputs(tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "missing.txt"
    with pytest.raises(StarpuLLMError, match="missing.txt.*does not exist"):
        prepare(missing, out)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(StarpuLLMError, match="empty.txt is empty"):
        prepare(empty, out)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"hello\n\xff\xfe world")
    with pytest.raises(StarpuLLMError, match="binary.txt is not valid UTF-8"):
        prepare(binary, out)
    with pytest.raises(StarpuLLMError, match=r"is not a regular file"):
        prepare(tmp_path, out)
    short = tmp_path / "short.txt"
    short.write_text(SMALL)
    with pytest.raises(StarpuLLMError, match=r"short.txt is too short for a validation split: it has \d+ tokens"):
        prepare(short, out)                  # default val_tokens=32768
    assert not out.exists() or not any(out.glob("*_train.bin"))


# a text whose blocks split everything a block can split: a "\r\n", UTF-8 sequences of 2 to 4
# bytes, runs of blank lines and of spaces, contractions, numbers, a literal <|endoftext|>
TRICKY = ("First Citizen:\r\nBefore we proceed, hear me speak.\r\n\r\n\r\n"
          "All:  \r\nSpeak,   speak. It's 1,234 caf\u00e9s \u65e5\u672c \U0001f600!\r\r"
          "Old Mac line\r\n\n\n\n\tTabbed  \n \nyou'll<|endoftext|>see\n\n  \n end")


def test_prepare_a_block_at_a_time_gives_the_whole_texts_ids(tmp_path):
    """prepare reads and tokenizes a block at a time (its memory a block's, not the file's:
    4.9 GB for a 300 MB file before): the ids are those of the whole text, whatever the
    block size cuts."""
    text = (TRICKY * 3).replace("\r\n", "\n").replace("\r", "\n")
    expected = encode("<|endoftext|>" + text.replace("\n\n", "\n\n<|endoftext|>"))
    src = tmp_path / "tricky.txt"
    raw = ("\ufeff" + TRICKY * 3).encode()       # with a byte-order mark
    src.write_bytes(raw)
    for block in [*range(1, 41), 97, 1000, len(raw)]:
        v, t = (formats.read_shard(p, 50257) for p in prepare(src, tmp_path / "out", val_tokens=7,
                                                               block=block)[::-1])
        assert v.tolist() + t.tolist() == expected, block
    # the text itself (a str) is cut the same way
    v, t = (formats.read_shard(p, 50257) for p in prepare(text, tmp_path / "out", val_tokens=7,
                                                           block=5)[::-1])
    assert v.tolist() + t.tolist() == expected
    # and a block's text is tokenized when it is read, not at the end
    pieces = list(data.document_ids(SMALL[i:i + 16] for i in range(0, len(SMALL), 16)))
    assert len(pieces) > len(SMALL) // 32 and max(p.size for p in pieces) < 16
    assert np.concatenate(pieces).tolist() == encode("<|endoftext|>" + SMALL.replace("\n\n", "\n\n<|endoftext|>"))


def test_prepare_refuses_what_is_not_text_wherever_a_block_ends(tmp_path):
    out = tmp_path / "out"
    nul = tmp_path / "utf16.txt"                   # valid UTF-8, but UTF-16 text or binary
    nul.write_bytes("Hello\n\nworld\n".encode("utf-16-le"))
    for block in (1, 2, 3, 64):                    # the NUL first in its block (1), or not
        with pytest.raises(StarpuLLMError, match="utf16.txt has a NUL byte at offset 1.*iconv -f UTF-16"):
            prepare(nul, out, val_tokens=1, block=block)
    late = tmp_path / "late.txt"                   # text, then a NUL in a later block
    late.write_bytes(b"Hello world.\n\n" * 4 + b"\0tail\n")
    for block in (1, 7, 8, 64):                    # 56: first in its block but at 64
        with pytest.raises(StarpuLLMError, match="late.txt has a NUL byte at offset 56,"):
            prepare(late, out, val_tokens=1, block=block)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9\n\n".encode() * 3 + "na\u00efve\n".encode("latin-1"))
    for block in (1, 2, 3, 5, 64):
        with pytest.raises(StarpuLLMError, match=r"latin1.txt is not valid UTF-8 \(bad byte at offset 23\)"):
            prepare(bad, out, val_tokens=1, block=block)
    cut = tmp_path / "cut.txt"                     # ends inside a 2-byte character
    cut.write_bytes("caf\u00e9\n".encode()[:4])
    for block in (1, 2, 64):
        with pytest.raises(StarpuLLMError, match=r"cut.txt is not valid UTF-8 \(bad byte at offset 3\)"):
            prepare(cut, out, val_tokens=1, block=block)
    assert not out.exists() or not os.listdir(out)


def test_prepare_replaces_the_shards_only_once_all_are_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    src = tmp_path / "small.txt"
    src.write_text(SMALL)
    old = prepare(src, out, val_tokens=5)
    before = {p: open(p, "rb").read() for p in (*old, out / "gpt2_tokenizer.bin")}
    src.write_text(SMALL + "\n\nAll:\nWe are resolved.\n")
    writes = []

    def disk_full(f, arr, crc=None):
        writes.append(arr.size)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(formats, "_write_array", disk_full)
    with pytest.raises(StarpuLLMError, match="small_train.bin failed: No space left on device"):
        prepare(src, out, val_tokens=5)
    assert writes
    assert {p: open(p, "rb").read() for p in before} == before     # the three files of the last run
    assert sorted(os.listdir(out)) == ["gpt2_tokenizer.bin", "small_train.bin", "small_val.bin"]
    monkeypatch.undo()
    with pytest.raises(StarpuLLMError, match="too short"):          # found at the text's end
        prepare(src, out, val_tokens=10_000)
    assert {p: open(p, "rb").read() for p in before} == before
    assert sorted(os.listdir(out)) == ["gpt2_tokenizer.bin", "small_train.bin", "small_val.bin"]


def _shard_names(out):
    return sorted(f for f in os.listdir(out) if "_train" in f)


def test_prepare_with_shard_tokens_writes_the_tokens_as_overlapping_shards(tmp_path):
    """shard_tokens N: the training tokens of the single shard as <name>_train_000000.bin, ...
    of N + 1 tokens (the last what is left), each but the first beginning with the one
    before's last token; the glob pattern returned names them in order; the validation
    shard as without; for every N, even a block at a time of 1 character."""
    src = tmp_path / "small.txt"
    src.write_text(SMALL * 3)
    single, val = prepare(src, tmp_path / "one", val_tokens=5)
    whole = formats.read_shard(single).tolist()
    for n, block in [(1, 8 << 20), (7, 1), (10, 64), (len(whole) - 1, 8 << 20), (len(whole), 3),
                     (10_000, 8 << 20)]:
        out = tmp_path / f"n{n}"
        train, val_n = prepare(src, out, val_tokens=5, shard_tokens=n, block=block)
        assert train == str(out / "small_train_*.bin")
        assert formats.read_shard(val_n).tolist() == formats.read_shard(val).tolist()
        paths = data.shard_paths(train)
        count = max(1, -(-(len(whole) - 1) // n))        # ceil: the shards' n-token steps
        assert [os.path.basename(p) for p in paths] == [f"small_train_{k:06d}.bin" for k in range(count)]
        for k, p in enumerate(paths):
            assert formats.read_shard(p).tolist() == whole[k * n:(k + 1) * n + 1], (n, k)
        assert sorted(os.listdir(out)) == ["gpt2_tokenizer.bin", *map(os.path.basename, paths),
                                           "small_val.bin"]
        assert data.val_shard_beside(train) == val_n
        assert data.val_shard_beside(paths[-1]) == val_n
    with pytest.raises(StarpuLLMError, match="shard_tokens 0 is not a shard size: give 1 .. 2147483646"):
        prepare(src, tmp_path / "bad", val_tokens=5, shard_tokens=0)
    with pytest.raises(StarpuLLMError, match="shard_tokens 2147483647 is not a shard size"):
        prepare(src, tmp_path / "bad", val_tokens=5, shard_tokens=2 ** 31 - 1)
    assert not (tmp_path / "bad").exists()


def test_prepare_into_a_folder_of_an_earlier_prepare_leaves_only_its_own_shards(tmp_path, monkeypatch):
    """A prepare replaces the training shards an earlier one of the same name wrote, and
    removes those it does not write (more shards then, or the other form): the pattern then
    names this run's shards only. One that fails (the disk full at its third shard, more
    shards than the names sort) leaves the earlier set as it was, no temporary file. A file
    the pattern matches that is not one of prepare's is refused before any work."""
    src = tmp_path / "small.txt"
    src.write_text(SMALL * 3)
    out = tmp_path / "out"
    tokens = formats.read_shard(prepare(src, tmp_path / "one", val_tokens=5)[0]).size
    names = lambda n: [f"small_train_{k:06d}.bin" for k in range(-(-(tokens - 1) // n))]  # noqa: E731
    small = lambda: [f for f in _shard_names(out) if f.startswith("small")]              # noqa: E731
    other = prepare(src, out, val_tokens=5, name="other", shard_tokens=10)[0]     # left alone
    others = {p: open(p, "rb").read() for p in data.shard_paths(other)}
    many = data.shard_paths(prepare(src, out, val_tokens=5, shard_tokens=10)[0])
    assert small() == names(10) and len(many) > len(names(40)) > 1
    prepare(src, out, val_tokens=5, shard_tokens=40)
    assert small() == names(40)
    assert prepare(src, out, val_tokens=5)[0] == str(out / "small_train.bin")
    assert small() == ["small_train.bin"]
    prepare(src, out, val_tokens=5, shard_tokens=10)
    assert small() == names(10)
    assert {p: open(p, "rb").read() for p in others} == others

    before = {p: open(p, "rb").read() for p in (*many, out / "small_val.bin", out / "gpt2_tokenizer.bin")}
    writes = []
    real = formats._write_array

    def full_at_the_third_shard(f, arr, crc=None):
        writes.append(f)                     # kept: their ids tell the files apart
        if len({id(w) for w in writes}) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, arr, crc)

    monkeypatch.setattr(formats, "_write_array", full_at_the_third_shard)
    with pytest.raises(StarpuLLMError, match="small_train_000002.bin failed: No space left on device"):
        prepare(src, out, val_tokens=5, shard_tokens=4)
    monkeypatch.undo()
    monkeypatch.setattr(data, "_MAX_SHARDS", 2)
    with pytest.raises(StarpuLLMError, match=r"small.txt makes more than 2 training shards of "
                                             r"shard_tokens 4; give a larger shard_tokens"):
        prepare(src, out, val_tokens=5, shard_tokens=4)
    monkeypatch.undo()
    with pytest.raises(StarpuLLMError, match="small.txt is too short for a validation split"):
        prepare(src, out, val_tokens=10_000, shard_tokens=4)       # found after the shards
    assert {p: open(p, "rb").read() for p in before} == before
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]

    (out / "small_train_notes.bin").write_text("my notes\n")
    with pytest.raises(StarpuLLMError, match=r"small_train_notes.bin matches the training shards' "
                                             r"pattern .*small_train_\*.bin but is not one that "
                                             r"prepare writes.*move it away, or give another out_dir"):
        prepare(src, out, val_tokens=5, shard_tokens=40)
    assert {p: open(p, "rb").read() for p in before} == before


# --------------------------------------------------------------------------- default dataset

def test_default_dataset_cached(tmp_path):
    cache = tmp_path / "cache"
    train, val = default_dataset()           # uses $STARPU_LLM_CACHE (set by the fixture)
    assert os.path.dirname(train) == str(cache) and os.path.basename(train) == "shakespeare_train.bin"
    assert os.path.basename(val) == "shakespeare_val.bin"
    v, t = formats.read_shard(val, 50257), formats.read_shard(train, 50257)
    assert v.size == 32768 and t.size > 300_000
    assert v[0] == 50256
    assert decode(v[:10]).startswith("<|endoftext|>THESEUS:\nNow, fair")
    mtimes = {p: os.stat(p).st_mtime_ns for p in (train, val)}
    assert default_dataset(cache) == (train, val)
    assert {p: os.stat(p).st_mtime_ns for p in (train, val)} == mtimes     # not re-tokenized
    assert sorted(os.listdir(cache)) == ["gpt2_tokenizer.bin", "shakespeare.json",
                                         "shakespeare_train.bin", "shakespeare_val.bin"]
    # a damaged cache is rebuilt
    with open(train, "r+b") as f:
        f.truncate(2000)
    default_dataset(cache)
    assert formats.read_shard(train).size == t.size


# --------------------------------------------------------------------------- DataLoader

def test_dataloader_batches_and_wrap(tmp_path):
    p = tmp_path / "d.bin"
    formats.write_shard(p, np.arange(20))
    dl = DataLoader(p, B=2, T=3)
    assert dl.num_batches == 3 and dl.position == 0
    assert isinstance(dl.tokens, np.memmap) and dl.tokens.dtype == np.uint16
    x, y = dl.next_batch()
    assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == (2, 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and y.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert dl.position == 6
    x, y = dl.next_batch()
    assert x.tolist() == [[6, 7, 8], [9, 10, 11]] and y.tolist() == [[7, 8, 9], [10, 11, 12]]
    x, y = dl.next_batch()                   # 12..18: the last batch that fits (12 + 7 <= 20)
    assert x.tolist() == [[12, 13, 14], [15, 16, 17]] and y.tolist() == [[13, 14, 15], [16, 17, 18]]
    assert dl.position == 0                  # 18 + 7 > 20: wraps
    x, _ = dl.next_batch()
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_dataloader_state_and_exact_sizes(tmp_path):
    dl = DataLoader(np.arange(7), B=2, T=3)  # exactly B*T+1 tokens: always batch 0
    for _ in range(3):
        x, y = dl.next_batch()
        assert x.ravel().tolist() == list(range(6)) and y.ravel().tolist() == list(range(1, 7))
    dl = DataLoader(np.arange(100), B=1, T=4)
    dl.next_batch(); dl.next_batch()
    st = dl.state()
    assert st == {"position": 8}
    expect = [dl.next_batch()[0].tolist() for _ in range(5)]
    dl2 = DataLoader(np.arange(100), B=1, T=4)
    dl2.load_state(st)
    assert [dl2.next_batch()[0].tolist() for _ in range(5)] == expect
    dl2.reset()
    assert dl2.position == 0 and dl2.next_batch()[0].tolist() == [[0, 1, 2, 3]]
    with pytest.raises(StarpuLLMError, match="position 97"):
        dl2.position = 97                    # 97 + 5 > 100
    dl2.position = 95
    assert dl2.next_batch()[1].tolist() == [[96, 97, 98, 99]]


def test_dataloader_bad_inputs(tmp_path):
    p = tmp_path / "small.bin"
    formats.write_shard(p, np.arange(10))
    with pytest.raises(StarpuLLMError) as ei:
        DataLoader(p, B=2, T=8)
    msg = str(ei.value)    # settings named as TrainConfig fields, as flags by the CLI
    assert "small.bin" in msg and "B*T+1 = 17" in msg and "has 10" in msg and "batch/seq_len" in msg
    assert "--batch/--seq-len" in ei.value.render(flag)
    with pytest.raises(StarpuLLMError, match="small.bin.*token id 9"):
        DataLoader(p, B=1, T=2, vocab_size=5)
    with pytest.raises(StarpuLLMError, match="nothere.bin"):
        DataLoader(tmp_path / "nothere.bin", B=1, T=2)


def test_an_id_past_the_vocabulary_in_a_shard_names_the_shard(tmp_path):
    """llm.c's shards hold uint16 ids, up to 65535 whatever the vocabulary: train's loader
    (vocab_size given) refuses the shard when it opens it, and a DataLoader made without one
    from Python, at the step whose batch holds the id (flow/step.check_positions), naming the
    shard's file there too (it said "the training data")."""
    from starpu_llm import MODELS, AdamW, ReferenceEngine, TrainState
    from starpu_llm.model.state import random_init
    config = MODELS["micro"]
    ids = np.random.default_rng(0).integers(0, config.V, 600)
    ids[300] = config.V + 5
    path = tmp_path / "other_vocab.bin"
    formats.write_shard(path, ids)
    with pytest.raises(StarpuLLMError, match=rf"other_vocab.bin contains token id {config.V + 5} "
                                             rf"\(the first out of range at token 300\)"):
        DataLoader(path, 2, 16, vocab_size=config.V)
    loader = DataLoader(path, 2, 16)
    state = TrainState(config=config, params=random_init(config))
    with ReferenceEngine(config, state, 2, 16, loader.tokens, threads=1) as eng:
        for _ in range(9):                   # batches at 0..256: ids 0..288
            eng.step(loader.next_position(), AdamW(1e-3))
        with pytest.raises(StarpuLLMError, match=rf"position 288: the training data \({path}\) holds "
                                                 rf"token id {config.V + 5}"):
            eng.step(loader.next_position(), AdamW(1e-3))


# --------------------------------------------------------------------------- several shards

def write_shards(folder, sizes, start=0):
    """Shards <folder>/d_train_<k>.bin of the given sizes, shard k's ids 100*k + 0, 1, ...,
    written in reverse order (the loader sorts them); and a validation shard the pattern
    d_train_*.bin does not match."""
    paths = [str(folder / f"d_train_{k:03d}.bin") for k in range(start, start + len(sizes))]
    for k, (p, n) in reversed(list(enumerate(zip(paths, sizes), start))):
        formats.write_shard(p, 100 * k + np.arange(n))
    formats.write_shard(folder / "d_val_000.bin", np.arange(50))
    return paths


def firsts(dl, n):
    """The first input id of the next n batches."""
    return [int(dl.next_batch()[0][0, 0]) for _ in range(n)]


def test_shards_are_read_in_sorted_order_a_batch_never_straddles_and_they_wrap(tmp_path):
    """A glob pattern: its shards in sorted order, each memory-mapped (a batch is a view into
    it, not a copy); a batch that would run past a shard's end is the next shard's first
    (llm.c's rule: shard 0's last 1 token and shard 1's are never read); after the last shard,
    the first's (an epoch)."""
    write_shards(tmp_path, [20, 13, 9])        # B*T+1 = 7: 3, 2 and 1 batches
    dl = DataLoader(str(tmp_path / "d_train_*.bin"), B=2, T=3)
    assert (dl.num_shards, dl.num_tokens, dl.num_batches) == (3, 42, 6)
    assert dl.describe() == f"{tmp_path / 'd_train_*.bin'} (42 tokens, 3 shards)"
    view = dl.next_tokens()
    assert isinstance(view, np.memmap) and view.filename.endswith("d_train_000.bin")
    assert np.shares_memory(view, dl.tokens) and view.tolist() == list(range(7))
    assert firsts(dl, 5) == [6, 12, 100, 106, 200]
    assert dl.state() == {"position": 0}       # shard 0 again: a new epoch
    assert firsts(dl, 4) == [0, 6, 12, 100] and dl.state() == {"shard": 1, "position": 6}
    x, y = dl.next_batch()                     # shard 1's last batch: 106..112, all 13
    assert x.ravel().tolist() == list(range(106, 112)) and y[-1, -1] == 112


def test_the_position_in_several_shards_is_saved_and_restored(tmp_path):
    write_shards(tmp_path, [20, 13, 9])
    pattern = str(tmp_path / "d_train_*.bin")
    dl = DataLoader(pattern, B=2, T=3)
    firsts(dl, 4)
    state = dl.state()
    assert state == {"shard": 1, "position": 6}
    expect = firsts(dl, 8)
    again = DataLoader(pattern, B=2, T=3)
    again.load_state(state)
    assert again.tokens.filename.endswith("d_train_001.bin") and firsts(again, 8) == expect
    again.load_state({"position": 12})         # no shard: shard 0 (a state saved before shards)
    assert firsts(again, 2) == [12, 100]
    with pytest.raises(StarpuLLMError, match=r"the state is at shard 3 \(counted from 0\), but "
                                             r".*d_train_\*\.bin has 3; .*give the shards it was "
                                             r"saved with"):
        again.load_state({"shard": 3, "position": 0})
    with pytest.raises(StarpuLLMError, match=r"data position 7 is outside .*d_train_002.bin"):
        again.load_state({"shard": 2, "position": 7})
    with pytest.raises(StarpuLLMError, match=r"next_position\(\) is a position in one shard, and "
                                             r".* has 3: take next_tokens\(\)"):
        again.next_position()


def test_each_shard_is_checked_and_its_errors_name_it(tmp_path):
    """Every shard's header and size when the loader is made (a bad one anywhere is refused
    at once, naming it), its ids when it is opened to be read; a pattern that matches
    nothing is named."""
    paths = write_shards(tmp_path, [20, 13, 9])
    pattern = str(tmp_path / "d_train_*.bin")
    with pytest.raises(StarpuLLMError, match=r"no file matches the pattern .*nothing_\*\.bin; "
                                             r".*quote it"):
        DataLoader(str(tmp_path / "nothing_*.bin"), 2, 3)
    with pytest.raises(StarpuLLMError, match=r"d_train_002.bin is too short: needs at least "
                                             r"B\*T\+1 = 11 tokens, has 9; .*every shard of .* "
                                             r"must hold a batch"):
        DataLoader(pattern, 2, 5)
    formats.write_shard(paths[2], 100 * 2 + np.arange(9))
    with open(paths[1], "r+b") as f:
        f.truncate(1024 + 2 * 10)              # its header says 13
    with pytest.raises(StarpuLLMError, match=r"d_train_001.bin is truncated"):
        DataLoader(pattern, 2, 3)
    formats.write_shard(paths[1], 100 + np.arange(13))
    dl = DataLoader(pattern, 2, 3, vocab_size=205)   # shard 2's ids are 200..208
    firsts(dl, 4)
    with pytest.raises(StarpuLLMError, match=r"d_train_002.bin contains token id 208 \(the "
                                             r"first out of range at token 5\)"):
        firsts(dl, 1)                          # shard 1's last batch: shard 2 opens


def test_an_engine_reads_a_shards_batches_through_views(tmp_path):
    """An engine made without token data (the trainer's) steps on the batches' own tokens,
    views into the memory-mapped shards (DataLoader.next_tokens): the same losses, bit for
    bit, as an engine over the shard stepping at the same positions, and the same validation
    loss on the next shard's batches; the load tasks read the view's memory itself
    (flow/step.token_pointer: no copy); a position without token data is refused."""
    from starpu_llm import MODELS, AdamW, StarPUEngine, TrainState
    from starpu_llm.model.state import random_init
    from starpu_llm.flow.step import token_pointer
    from starpu_llm.plan.partition import PartitionRequest
    from starpu_llm.runtime import Runtime, resolve_here
    from starpu_llm._kernels import ffi
    config = MODELS["micro"]
    rng = np.random.default_rng(3)
    paths = [str(tmp_path / f"s_{k}.bin") for k in range(2)]
    for p in paths:
        formats.write_shard(p, rng.integers(0, config.V, 70))     # 2 batches of 2 x 16 each
    loader = DataLoader(str(tmp_path / "s_*.bin"), 2, 16, config.V)
    view = loader.next_tokens()
    assert int(ffi.cast("uintptr_t", token_pointer(view))) == view.ctypes.data
    loader.reset()
    with Runtime(resolve_here(PartitionRequest(workers=1, cores_per_worker=1))) as rt:
        state = TrainState(config=config, params=random_init(config))
        with StarPUEngine(config, state, 2, 16, None, rt) as eng:
            got = [eng.step(loader.next_tokens(), AdamW(1e-3)) for _ in range(2)]
            second = [loader.next_tokens() for _ in range(2)]
            assert all(v.filename.endswith("s_1.bin") for v in second)
            val = (eng.validation_loss(None, second),
                   eng.validation_loss(formats.read_shard(paths[1]), [0, 32]))
            with pytest.raises(StarpuLLMError, match="position 0: the engine was made without "
                                                     "token data"):
                eng.step(0, AdamW(1e-3))
            with pytest.raises(StarpuLLMError, match=r"a batch's tokens of the training data: 70 "
                                                     r"ids, but a batch of 2 x 16 reads B\*T\+1 = 33"):
                eng.step(formats.read_shard(paths[0]), AdamW(1e-3))
        state = TrainState(config=config, params=random_init(config))
        with StarPUEngine(config, state, 2, 16, formats.read_shard(paths[0]), rt) as eng:
            want = [eng.step(pos, AdamW(1e-3)) for pos in (0, 32)]
    assert got == want and val[0] == val[1]


def test_an_engine_holds_the_last_two_steps_batches_and_lets_older_ones_go():
    """An engine made without token data holds the tokens of the last two steps' batches,
    whose load tasks may not have run yet (the trainer submits a step once the one before
    the previous was read: flow/step.py), and no older ones (a shard the loader moved past
    is unmapped once no step reads it)."""
    import gc
    import weakref
    from starpu_llm import MODELS, AdamW, ReferenceEngine, TrainState
    from starpu_llm.model.state import random_init
    config = MODELS["micro"]
    rng = np.random.default_rng(4)
    state = TrainState(config=config, params=random_init(config))
    held = []
    with ReferenceEngine(config, state, 2, 8, None, threads=1) as eng:
        for step in range(4):
            batch = rng.integers(0, config.V, 2 * 8 + 1).astype(np.uint16)
            held.append(weakref.ref(batch))
            eng.step(batch, AdamW(1e-3))
            del batch
            gc.collect()
            assert [r() is not None for r in held] == [k >= step - 1 for k in range(step + 1)]


def test_validation_takes_the_first_batches_of_several_shards_in_order(tmp_path):
    """--val-batches M over several validation shards: the first M batches in the loader's
    order (shard after shard), all of them (an epoch, no wrap) when they have fewer."""
    from starpu_llm.training.validation import Validation
    write_shards(tmp_path, [20, 13, 9])
    pattern = str(tmp_path / "d_train_*.bin")
    four = Validation(pattern, 2, 3, 300, every=1, batches=4)
    assert [int(t[0]) for t in four.tokens] == [0, 6, 12, 100]
    every = Validation(pattern, 2, 3, 300, every=1, batches=10)
    assert every.batches == 6 and [int(t[0]) for t in every.tokens] == [0, 6, 12, 100, 106, 200]
    assert "(42 tokens, 3 shards), 6 batch(es)" in every.describe()
