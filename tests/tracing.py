"""Test helpers: run one training step under the task trace and name its handles."""
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.model.config import AdamW
from starpu_llm.plan.sites import Sites
from starpu_llm.plan.topology import Topology
from starpu_llm.model.state import TrainState, random_init
from partitions import subs


def traced_step(runtime, config, tokens, B=4, T=16, sub_batches=None, grad_clip=0.0,
                wte_blocks=None, steps=1):
    """One training step under a task trace: (events, {handle address: tensor name}); wte in
    wte_blocks row blocks when given (else the placement's: one in one process). steps > 1:
    that many, each after the first submitted before the previous one is waited for (the
    trainer's submit-ahead loop: Engine.submit_step with keep_previous)."""
    state = TrainState(config=config, params=random_init(config))
    runtime.start_trace(100_000)
    try:
        # wte's blocks: the sites of a topology with that many (as the performance model
        # records a partition's step), else the engine's own
        sites = (Sites(Topology(config, 1, wte_blocks=wte_blocks), sub_batches or 1,
                       runtime.partition.workers, runtime.partition.pins_sub_batches)
                 if wte_blocks else None)
        eng = StarPUEngine(config, state, B, T, tokens, runtime, subs(runtime, sub_batches),
                           sites=sites)
        try:
            for k in range(steps):
                eng.submit_step(0, AdamW(1e-3, grad_clip=grad_clip), keep_previous=k > 0)
            eng.wait()
            names = eng.tensor_names()
        finally:
            eng.close()
        return runtime.trace(), names
    finally:
        runtime.stop_trace()


def named_buffers(event, names):
    """[(tensor name, SL_ACCESS_* mode)] of a traced task, as StarPU gave them to it."""
    return [(names.get(h, hex(h)), mode) for h, mode in event[5]]
