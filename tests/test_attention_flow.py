"""The fused attention through StarPU on CPU workers: a partition of attention "flash" lays each
sub-batch's tensors out for it (att holds each query row's logsumexp (B,NH,T): no (T, T)
tensor anywhere), the task flow submits its codelets (their CPU bodies here, the same tiled
algorithm as the CUDA kernels), and the small model's forward/backward and 10 AdamW steps
equal the reference engine's on the same kernels bitwise and stay within test_model.py's
bounds of the torch oracle (the fused attention's chain lengths, bounds.py)."""
from dataclasses import replace

import numpy as np
import pytest

from starpu_llm import Runtime, StarpuLLMError
from starpu_llm.model.config import AdamW, GPTConfig, ParamLayout
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.model.state import TrainState
from partitions import here
from test_model import compare, make_case, report, run_engine, run_torch


@pytest.fixture(scope="module")
def runtime():
    rt = Runtime(here(1, 1, attention="flash"))
    yield rt
    rt.shutdown()


def test_a_partition_must_say_its_attention():
    # partition.resolve decides the form; a Partition made otherwise says it (refused before
    # anything starts: another runtime may be running)
    blank = replace(here(1, 1), attention="")
    with pytest.raises(StarpuLLMError, match="no attention form.*PartitionRequest\\(attention=\\)"):
        Runtime(blank)


def test_the_runtime_lays_out_the_fused_attention(runtime):
    case = make_case("small")
    cfg = case.config
    eng = StarPUEngine(cfg, TrainState(config=cfg, params=case.params.copy()), case.B, case.T,
                       case.tokens, runtime=runtime, record=True)
    try:
        eng.step(0, AdamW(1e-3))
        names = eng.submitted()
        a, (s,) = eng.subs[0]
    finally:
        eng.close()
    assert names.count("attention_flash_forward") == cfg.L
    assert names.count("attention_flash_backward") == cfg.L
    assert "attention_forward" not in names and "attention_backward" not in names
    assert a.attention == "flash" and a.att[0].shape == (case.B, cfg.NH, case.T)
    assert s.att_scratch.shape == (case.B, cfg.NH, case.T)


def test_fused_attention_flow_matches_reference_and_torch(runtime):
    case = replace(make_case("small"), attention="flash")
    out = {}
    with runtime.paused():
        run_torch(case, out)
    bounds = out["bounds"]
    layout = ParamLayout(case.config)
    starpu = run_engine("starpu", case, runtime)
    with runtime.paused():
        ref = run_engine("reference", case, runtime)
    e = compare(layout, *starpu, *ref, bounds.params)
    assert e.logits == 0.0 and e.loss == 0.0
    assert all(np.all(d == 0.0) for d in e.grads.values())
    assert e.step_losses.max() == 0.0 and all(d == 0.0 for d, _ in e.params.values())
    e = compare(layout, *starpu, (out["logits"], out["loss"], out["grads"]),
                (out["losses"], out["params"]), bounds.params)
    report("small] [starpu flash", e, case, bounds)
    ratios = e.ratios(case, bounds)
    assert all(r <= 1.0 for r in ratios.values()), ratios


def test_a_head_too_wide_for_the_cuda_kernels_is_refused_before_any_task(runtime, monkeypatch):
    """The fused attention's CUDA kernels keep a row in registers, heads of up to
    SL_FLASH_MAX_HS channels: with GPUs a wider head is refused with the setting to change,
    before any task (the CPU body takes any head, as this CPU runtime shows)."""
    from starpu_llm._clib import lib
    from starpu_llm.model.state import random_init
    wide = GPTConfig(max_seq_len=16, vocab_size=97, padded_vocab_size=128, num_layers=1,
                     num_heads=1, channels=2 * lib.SL_FLASH_MAX_HS)
    tokens = np.arange(200, dtype=np.uint16) % 97

    def engine():
        state = TrainState(config=wide, params=random_init(wide))
        return StarPUEngine(wide, state, 1, 16, tokens, runtime=runtime)
    engine().close()                                  # CPU workers only: runs
    monkeypatch.setattr(runtime, "partition",         # as a GPU runtime would start it
                        replace(runtime.partition, gpus=1))
    with pytest.raises(StarpuLLMError, match=r'heads of up to 64 channels, and this model\'s '
                       r'have 128 \(128 channels / 1 heads\): run it with attention gemm'):
        engine()
