"""Task order from a trace of real steps: an update never starts before its gradient is final."""
import numpy as np
import pytest

from starpu_llm import Runtime
from starpu_llm._clib import lib
from starpu_llm.config import MODELS
from starpu_llm.runtime import usable_cores
from tracing import traced_step

MICRO = MODELS["micro"]
TOKENS = np.random.default_rng(0).integers(0, MICRO.V, 4000).astype(np.uint16)


@pytest.mark.parametrize("workers,cores,sub_batches", [(1, 1, None), (1, 1, 2), (2, 1, None),
                                                       (1, 2, 2)])
def test_update_starts_after_its_gradient_is_final(workers, cores, sub_batches):
    """Every AdamW task starts after every task that wrote or contributed to its gradient has
    ended: the backward task that finalised it and, with sub-batches, every contribution and
    StarPU's reduction of them. Handles and modes are those StarPU gave the running tasks."""
    if workers * cores > usable_cores():
        pytest.skip(f"a {workers}x{cores} partition needs {workers * cores} cores; "
                    f"this process may use {usable_cores()}")
    with Runtime(workers, cores) as rt:
        events, names = traced_step(rt, MICRO, TOKENS, sub_batches=sub_batches)
    writes = lib.SL_ACCESS_W | lib.SL_ACCESS_REDUX
    last_write = {}   # gradient handle -> end of the last task writing it, other than AdamW
    for e in events:
        if e[0] != "adamw" and e[5]:
            for h, mode in e[5]:
                if mode & writes and names.get(h, "").startswith("grad."):
                    last_write[h] = max(last_write.get(h, 0), e[4])
    updates = [e for e in events if e[0] == "adamw"]
    assert len(updates) == 12 * MICRO.L + 4
    for e in updates:
        grad = e[5][1][0]
        assert names[grad].startswith("grad.")
        assert grad in last_write, f"no task wrote {names[grad]}"
        assert e[3] >= last_write[grad], (
            f"adamw of {names[grad]} started {(last_write[grad] - e[3]) / 1e3:.0f} us "
            "before its gradient was final")
