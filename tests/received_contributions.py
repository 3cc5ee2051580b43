"""Run under mpirun by tests/test_mpi.py: data parallelism on the micro model under an
ownership scheme, two steps; rank 0 prints one JSON line, a list of each rank's: for every
other rank's contribution to a gradient slice this rank owns (the ones it receives), where
its memory on this rank is before the first step and after each step (0: none).

    mpirun -np R python tests/received_contributions.py OWNERSHIP SHARD
"""
import json
import sys

from starpu_llm._clib import ffi, lib
from starpu_llm.model.config import MODELS, AdamW
from starpu_llm.flow.engine import StarPUEngine
from starpu_llm.io import formats
from starpu_llm.runtime import mpi
from starpu_llm.runtime.starpu import Runtime
from starpu_llm.model.state import TrainState, random_init
from partitions import here, subs


def main(ownership, shard):
    cfg, comm = MODELS["micro"], mpi.world()
    R, rank = comm.Get_size(), comm.Get_rank()
    tokens = formats.read_shard(shard, cfg.V)
    with Runtime(here(1, 1, oversubscribe=True, comm=comm), comm=comm) as rt:
        eng = StarPUEngine(cfg, TrainState(config=cfg, params=random_init(cfg)), 2 * R, 16,
                           tokens, rt, subs(rt, ownership=ownership))
        mine = {key for key, owner in eng.sites.topology.owners.items() if owner == rank}
        keys = [key for key, _, _ in eng.layout.slice_list(eng.sites.topology.wte_blocks)]
        received = [t for d, group in enumerate(eng.contributions) if d != rank
                    for key, t in zip(keys, group.tensors())
                    if key in mine]
        def where_now():
            return [int(ffi.cast("uintptr_t", lib.sl_home_ptr(t.h))) for t in received]
        where = [where_now()]
        for step in range(2):
            eng.step(step * 2 * R * 16, AdamW(1e-3))
            where.append(where_now())
        eng.close()
    every = comm.gather(dict(rank=rank, owned=len(mine), received=len(received), where=where))
    if rank == 0:
        print(json.dumps(every), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
