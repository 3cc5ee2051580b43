"""A list-scheduling model of a 2-stage pipeline's step, to choose how many activation sets
a stage needs (docs/scaling.md, StarPU-MPI internals, Schedule). No StarPU: each micro-batch
is five tasks on its route, F0 (stage 0's blocks forward) -> F1 (stage 1's forward) -> H
(the head on stage 0: forward, loss, backward) -> B1 (stage 1's backward) -> B0 (stage 0's
backward and the embedding's); a micro-batch's H, B1 and B0 follow the previous one's (the
gradient chains); with K0 / K1 sets on stage 0 / 1, F0 of micro-batch m waits for B0 of
m - K0 and F1 of m for B1 of m - K1 (the write-after-read of a shared set). Each stage runs
one task at a time, choosing among the ready ones by a policy: ready (first ready first:
lws without priorities), bwd (backward, then head, then forward: 1f1b's priorities), fwd
(forward, then head, then backward: eager's and gpipe's).
Prints the step length and each stage's busy fraction for M micro-batches and each (K0, K1).

    python3 experiments/pipeline_schedule_sim.py [--costs F0,F1,H,B1,B0] [--micro 4,8]
"""
import argparse

STAGE = {"F0": 0, "F1": 1, "H": 0, "B1": 1, "B0": 0}
ROUTE = ["F0", "F1", "H", "B1", "B0"]
RANK = {"bwd": {"B0": 0, "B1": 0, "H": 1, "F1": 2, "F0": 2},
        "fwd": {"B0": 2, "B1": 2, "H": 1, "F1": 0, "F0": 0}}


def simulate(M, K0, K1, policy, cost):
    """(step length, [busy fraction of stage 0, of stage 1])."""
    deps = {}
    for m in range(M):
        for i, p in enumerate(ROUTE):
            d = [(ROUTE[i - 1], m)] if i else []
            if p in ("H", "B1", "B0") and m:
                d.append((p, m - 1))
            if p == "F0" and m >= K0:
                d.append(("B0", m - K0))
            if p == "F1" and m >= K1:
                d.append(("B1", m - K1))
            deps[(p, m)] = d
    done, free, left = {}, [0.0, 0.0], set(deps)
    while left:
        best = None
        for stage in (0, 1):
            ready = {k: max([done[x] for x in deps[k]] + [0.0]) for k in left
                     if STAGE[k[0]] == stage and all(x in done for x in deps[k])}
            if not ready:
                continue
            start = max(free[stage], min(ready.values()))
            avail = [k for k, t in ready.items() if t <= start]
            if policy == "ready":
                k = min(avail, key=lambda k: (ready[k], k[1]))
            else:
                k = min(avail, key=lambda k: (RANK[policy][k[0]], k[1]))
            if best is None or start < best[0]:
                best = (start, stage, k)
        start, stage, k = best
        done[k] = free[stage] = start + cost[k[0]]
        left.discard(k)
    span = max(done.values())
    return span, [sum(cost[k[0]] for k in deps if STAGE[k[0]] == s) / span for s in (0, 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default="85,246,410,440,155",
                    help="ms per micro-batch of F0,F1,H,B1,B0 (default: the 2-stage GPT-2 124M "
                         "Gantt chart of experiments/results/ownership/amd-epyc-avx2/"
                         "gpipe-priorities, B=8, 4 micro-batches; the earlier chart's, with "
                         "stage 1 the slower: 170,555,575,635,210)")
    ap.add_argument("--micro", default="4,8")
    args = ap.parse_args()
    cost = dict(zip(["F0", "F1", "H", "B1", "B0"], map(float, args.costs.split(","))))
    print("M policy K0 K1 step_ms busy0 busy1")
    for M in map(int, args.micro.split(",")):
        for policy in ("ready", "bwd", "fwd"):
            for K0, K1 in [(M, M), (2, 2), (3, 2), (3, 3), (4, 4)]:
                if K0 <= M and K1 <= M:
                    span, busy = simulate(M, K0, K1, policy, cost)
                    print(M, policy, K0, K1, round(span), *(f"{b:.2f}" for b in busy))


if __name__ == "__main__":
    main()
