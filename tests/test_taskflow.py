"""The task flow: what is submitted per step, handle reuse and bounded memory, the trace."""
from dataclasses import fields

import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import lib
from tracing import named_buffers, traced_step
from starpu_llm._kernels import ffi as kffi, lib as klib
from starpu_llm.kernels.codelets import TABLE, add_methods, split_call
from starpu_llm.model.config import MODELS, AdamW, ParamLayout
from starpu_llm.flow import taskflow
from starpu_llm.flow.tensors import ATTENTIONS, ParameterTensors, Tensor, sub_batch_tensors
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.model.state import TrainState, random_init
from starpu_llm.training.trainer import TrainConfig, train
from partitions import here

MICRO = MODELS["micro"]


def tokens(n=4000, seed=0):
    return np.random.default_rng(seed).integers(0, MICRO.V, n).astype(np.uint16)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def runtime():
    rt = Runtime(here(1, 1))
    yield rt
    rt.shutdown()


def test_tasks_per_step(runtime):
    L = MICRO.L
    state = TrainState(config=MICRO, params=random_init(MICRO))
    eng = StarPUEngine(MICRO, state, 2, 16, tokens(), runtime, record=True)
    try:
        eng.step(0, AdamW(1e-3))
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


def test_the_cpu_engine_keeps_the_gemm_attention(runtime):
    # without GPUs the attention is the CPU engine's (att (B,NH,T,T)), to the bit as before
    assert runtime.attention == "gemm"


def test_attention_backward_declares_its_scratch(runtime):
    """The attention backward's scratch buffer is written inside the task: StarPU must have
    been told so (W), or two layers' backward tasks could overlap on it."""
    events, names = traced_step(runtime, MICRO, tokens())
    bufs = [named_buffers(e, names) for e in events if e[0] == "attention_backward"]
    assert len(bufs) == MICRO.L
    for b in bufs:
        assert ("s0.att_scratch", lib.SL_ACCESS_W) in b and ("s0.dqkv", lib.SL_ACCESS_W) in b, b


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_forward_keeps_only_what_the_backward_reads(attention):
    """Nothing is stored that no backward reads: every per-layer activation a forward task
    writes is read by a backward task, in either form of the attention (the scores preatt,
    written by the attention and read by nothing, were 9.7 GB at d12, B=8 x T=1024)."""
    B, T = 2, 16
    layout = ParamLayout(MICRO)
    p, g, m, v = (ParameterTensors.of_shapes(kind, layout) for kind in ("param", "grad", "m", "v"))
    tensor = lambda name, shape, dtype: Tensor(name, shape, dtype)    # noqa: E731
    a, s = sub_batch_tensors(MICRO, B, T, tensor, attention=attention)

    class Access:
        """taskflow's executor that runs nothing: the tensors each task reads and writes."""
        def __init__(self):
            self.read, self.written = set(), set()

        def at(self, where):
            return self

    def access(self, cd, args, kwargs):
        kwargs.pop("redux", None)
        buffers, _ = split_call(cd, args, kwargs)
        modes = kffi.new("int32_t[]", klib.SL_MAX_BUFFERS)
        klib.sl_codelet_modes(cd.id, 0, 0, modes, klib.SL_MAX_BUFFERS)
        for i, t in enumerate(buffers):
            if t is not None and modes[i] & klib.SL_ACCESS_R:
                self.read.add(t.name)
            if t is not None and modes[i] & klib.SL_ACCESS_W:
                self.written.add(t.name)

    add_methods(Access, TABLE, access)
    fwd, bwd = Access(), Access()
    taskflow.forward(fwd, MICRO, p, a, B, T)
    taskflow.backward(bwd, MICRO, p, g, a, s, B, T, 1.0, 0)
    # except the branches' outputs attproj and fcproj, read by the residual adds only (llm.c
    # keeps them too; 2 L B T C floats, 0.6 GB at d12, B=8 x T=1024: an add into res2 / res3
    # in place would drop them), named here so that any other shows
    layered = {t.name for f in fields(a) if f.metadata["layered"]
               and f.name not in ("attproj", "fcproj") for t in getattr(a, f.name)}
    kept = fwd.written & layered
    assert kept and kept <= bwd.read, sorted(kept - bwd.read)
    assert a.att[0].shape == ((B, MICRO.NH, T) if attention == "flash"
                              else (B, MICRO.NH, T, T))


def test_memory_does_not_grow_with_steps(runtime):
    state = TrainState(config=MICRO, params=random_init(MICRO))
    eng = StarPUEngine(MICRO, state, 4, 32, tokens(20000), runtime)
    try:
        for i in range(5):
            eng.step(i * 128, AdamW(1e-3))
        before = rss_mb()
        for i in range(5, 60):
            eng.step((i * 128) % 15000, AdamW(1e-3))
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
