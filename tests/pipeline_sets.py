"""Run under mpirun by tests/test_mpi.py: one step of a micro-batched pipeline on the micro
model under the task trace; rank 0 prints one JSON line, a list of each rank's: the
activation and scratch handles of each stage (which micro-batches share them), and the
priorities the traced tasks of each codelet ran with.

    mpirun -np S python tests/pipeline_sets.py SCHEDULE MICRO_BATCHES SHARD
"""
import json
import sys


from starpu_llm.model.config import MODELS, AdamW
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.io import formats
from starpu_llm.runtime import mpi
from starpu_llm.runtime.starpu import Runtime
from starpu_llm.model.state import TrainState, random_init
from partitions import here


def main(schedule, micro, shard):
    cfg, comm = MODELS["micro"], mpi.world()
    S, B, T = comm.Get_size(), 2 * int(micro), 16
    tokens = formats.read_shard(shard, cfg.V)
    with Runtime(here(1, 1, oversubscribe=True, comm=comm), comm=comm) as rt:
        eng = StarPUEngine(cfg, TrainState(config=cfg, params=random_init(cfg)), B, T, tokens,
                           rt, here(1, 1, oversubscribe=True, comm=comm, sub_batches=int(micro),
                                    pipeline_stages=S, pipeline_schedule=schedule))
        rt.start_trace(100_000)
        try:
            eng.step(0, AdamW(1e-3))
            events = rt.trace()
        finally:
            rt.stop_trace()
        # which micro-batches share each tensor: per (stage, tensor name), the first
        # micro-batch holding the same tensor as micro-batch j, for every j
        layer_stage = eng.sites.topology.layer_stage
        shared = {}
        for j, (a, stages) in enumerate(eng.subs):
            named = [(0 if "[" not in t.name else layer_stage[int(t.name.split("[")[1][:-1])],
                      t.name, t) for t in a.tensors()]
            named += [(k, f"scratch.{t.name}", t) for k, s in enumerate(stages)
                      for t in s.tensors()]
            for stage, name, t in named:
                firsts = shared.setdefault(f"{stage}:{name}", [])
                owners = [i for i, (b, sb) in enumerate(eng.subs[:j])
                          if any(u is t for u in b.tensors())
                          or any(u is t for x in sb for u in x.tensors())]
                firsts.append(owners[0] if owners else j)
        priorities = {}
        for e in events:
            priorities.setdefault(e.codelet, set()).add(e.priority)
        eng.close()
    mine = dict(rank=comm.Get_rank(), sets=eng.sites.sets, shared=shared,
                priorities={k: sorted(v) for k, v in priorities.items()})
    every = comm.gather(mine)     # one line from rank 0: the ranks' lines could interleave
    if comm.Get_rank() == 0:
        print(json.dumps(every), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
