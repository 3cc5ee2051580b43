"""The task flow: what is submitted per step, handle reuse and bounded memory, the trace."""
import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import lib
from tracing import named_buffers, traced_step
from starpu_llm.config import MODELS
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.state import TrainState, random_init
from starpu_llm.trainer import TrainConfig, train

MICRO = MODELS["micro"]


def tokens(n=4000, seed=0):
    return np.random.default_rng(seed).integers(0, MICRO.V, n).astype(np.uint16)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def runtime():
    rt = Runtime(1, 1)
    yield rt
    rt.shutdown()


def test_tasks_per_step(runtime):
    L = MICRO.L
    state = TrainState(config=MICRO, params=random_init(MICRO))
    eng = StarPUEngine(MICRO, state, 2, 16, tokens(), runtime, record=True)
    try:
        eng.step(0, 1e-3, 0.0)
        names = eng.submitted()
    finally:
        eng.close()
    forward = 1 + 10 * L + 2      # encoder, 10 per block, lnf + lm head
    backward = 3 + 8 * L + 1      # loss grad, lm head, lnf; 8 per block; encoder
    updates = 12 * L + 4          # one AdamW per tensor per layer + wte, wpe, lnfw, lnfb
    assert names[0] == "load_batch"
    assert names.count("crossentropy_forward") == 1
    assert len(names) == 1 + forward + 1 + backward + updates
    assert names.count("adamw") == updates
    # every update comes after the backward task that finalises its gradient
    first_update = names.index("adamw")
    assert "encoder_backward" in names[:first_update]


def test_update_reads_final_gradient(runtime):
    """Each AdamW task, as StarPU ran it, reads and writes params, grads, m, v of exactly one
    tensor slice (the access modes StarPU was given, read back from the running task)."""
    events, names = traced_step(runtime, MICRO, tokens())
    updates = [named_buffers(e, names) for e in events if e[0] == "adamw"]
    assert len(updates) == 12 * MICRO.L + 4
    rw = lib.SL_ACCESS_R | lib.SL_ACCESS_W
    for bufs in updates:
        assert [m for _, m in bufs] == [rw] * 4, bufs
        kinds = [n.split(".", 1) for n, _ in bufs]
        assert [k for k, _ in kinds] == ["param", "grad", "m", "v"], bufs
        assert len({t for _, t in kinds}) == 1, bufs     # one tensor slice
    assert len({tuple(u) for u in updates}) == len(updates)
    assert [("param.qkvw[1]", rw), ("grad.qkvw[1]", rw), ("m.qkvw[1]", rw),
            ("v.qkvw[1]", rw)] in updates


def test_attention_backward_declares_its_scratch(runtime):
    """The attention backward's scratch buffer is written inside the task: StarPU must have
    been told so (W), or two layers' backward tasks could overlap on it."""
    events, names = traced_step(runtime, MICRO, tokens())
    bufs = [named_buffers(e, names) for e in events if e[0] == "attention_backward"]
    assert len(bufs) == MICRO.L
    for b in bufs:
        assert ("s0.att_scratch", lib.SL_ACCESS_W) in b and ("s0.dqkv", lib.SL_ACCESS_W) in b, b


def test_memory_does_not_grow_with_steps(runtime):
    state = TrainState(config=MICRO, params=random_init(MICRO))
    eng = StarPUEngine(MICRO, state, 4, 32, tokens(20000), runtime)
    try:
        for i in range(5):
            eng.step(i * 128, 1e-3, 0.0)
        before = rss_mb()
        for i in range(5, 60):
            eng.step((i * 128) % 15000, 1e-3, 0.0)
        after = rss_mb()
    finally:
        eng.close()
    assert after - before < 8, (before, after)


def test_trace_records_each_task(tmp_path, runtime):
    from starpu_llm.io import formats
    path = str(tmp_path / "t.bin")
    formats.write_shard(path, tokens())
    r = train(TrainConfig(model="micro", train_data=path, batch=2, seq_len=16, steps=2,
                          trace=True, log=None), runtime=runtime)
    assert runtime.running
    names = {e[0] for e in r.trace}
    assert {"load_batch", "matmul_forward", "attention_backward", "adamw"} <= names
    assert all(e[4] >= e[3] for e in r.trace)   # end after start
    assert all(e[2] == 1 for e in r.trace)      # 1 core per task in a 1x1 partition
