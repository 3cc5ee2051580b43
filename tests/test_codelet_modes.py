"""Each task's access modes are declared once, in the C codelet table (SL_CODELET), which the
submit helpers build their tasks from: StarPU must have run every task of a real step with
exactly the declared modes (read back from the running task by the trace)."""
import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import ffi, lib
from starpu_llm.config import MODELS
from starpu_llm.runtime import usable_cores
from tracing import traced_step

MICRO = MODELS["micro"]
TOKENS = np.random.default_rng(0).integers(0, MICRO.V, 4000).astype(np.uint16)


def declared(codelet, redux, accumulate):
    """The codelet's declared SL_ACCESS_* modes for a task with this redux / accumulate."""
    modes = ffi.new("int32_t[]", lib.SL_TRACE_MAXBUF)
    n = lib.sl_codelet_modes(codelet, redux, accumulate, modes, lib.SL_TRACE_MAXBUF)
    assert 0 <= n <= lib.SL_TRACE_MAXBUF, n
    return [int(m) for m in modes[0:n]]


def allowed(codelet, redux):
    """Every mode list a task of the codelet may run with in a step of this redux: either
    accumulate, with or without its optional trailing buffers (any number of the last)."""
    out = set()
    for accumulate in (0, 1):
        modes = declared(codelet, redux, accumulate)
        full = tuple(m & ~lib.SL_ACCESS_OPTIONAL for m in modes)
        out.add(full)
        n = len(modes)
        while n and modes[n - 1] & lib.SL_ACCESS_OPTIONAL:
            n -= 1
            out.add(full[:n])
    return out


def test_declared_table():
    ids = {ffi.string(lib.sl_codelet_name(i)).decode(): i for i in range(lib.sl_codelet_count())}
    r, w, rw, redux = lib.SL_ACCESS_R, lib.SL_ACCESS_W, lib.SL_ACCESS_R | lib.SL_ACCESS_W, lib.SL_ACCESS_REDUX
    opt = lib.SL_ACCESS_OPTIONAL
    assert declared(ids["adamw"], 0, 0) == [rw] * 4 + [r | opt]     # [the gradient norm]
    assert declared(ids["grad_sumsq"], 0, 0) == [w, r]
    assert declared(ids["norm_sum"], 0, 0) == [w, r] + [r | opt] * 6
    assert declared(ids["matmul_backward"], 0, 0) == [w, rw, r, r, r, rw | opt]
    assert declared(ids["matmul_backward"], 1, 0) == [w, redux, r, r, r, redux | opt]
    assert declared(ids["layernorm_backward"], 0, 0)[0] == w
    assert declared(ids["layernorm_backward"], 0, 1)[0] == rw
    assert lib.sl_codelet_modes(lib.sl_codelet_count(), 0, 0, ffi.NULL, 0) < 0


# redux: the gradients' mode the placement gives these sub-batches: a StarPU reduction when
# each of 2 one-core workers runs one sub-batch, a chain (RW) when they share the one worker
@pytest.mark.parametrize("workers,sub_batches,redux,grad_clip", [
    (1, None, 0, 0.0), (1, 2, 0, 0.0), (2, None, 1, 0.0), (2, None, 1, 1.0)])
def test_traced_modes_are_the_declared_ones(workers, sub_batches, redux, grad_clip):
    if workers > usable_cores():
        pytest.skip(f"{workers} one-core workers need {workers} cores; this process may use "
                    f"{usable_cores()}")
    with Runtime(workers, 1) as rt:
        events, _ = traced_step(rt, MICRO, TOKENS, sub_batches=sub_batches, grad_clip=grad_clip)
    ids = {ffi.string(lib.sl_codelet_name(i)).decode(): i for i in range(lib.sl_codelet_count())}
    seen = set()
    for name, _, _, _, _, buffers, *_ in events:
        if buffers is None:   # a reduction method StarPU ran inline inside another task
            continue
        modes = tuple(m for _, m in buffers)
        variants = allowed(ids[name], redux)
        assert modes in variants, (name, modes, variants)
        seen.add((name, modes))
    names = {n for n, _ in seen}
    assert {"load_batch", "encoder_forward", "encoder_backward", "matmul_forward",
            "matmul_backward", "attention_backward", "layernorm_backward", "adamw"} <= names
    # both variants of the per-task modes ran: with and without bias, accumulate 0 and 1
    assert {len(m) for n, m in seen if n == "matmul_backward"} == {5, 6}
    assert {m[0] for n, m in seen if n == "layernorm_backward"} == {
        lib.SL_ACCESS_W, lib.SL_ACCESS_R | lib.SL_ACCESS_W}
    # the update reads the gradient norm exactly when clipping; the norm's tasks ran then only
    assert {len(m) for n, m in seen if n == "adamw"} == ({5} if grad_clip else {4})
    assert ({"grad_sumsq", "norm_sum"} <= names) == bool(grad_clip)
