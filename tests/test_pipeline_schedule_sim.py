"""experiments/pipeline_schedule_sim.py: the 2-stage route's list-scheduling model behind the
pipeline schedules' sets and priorities (docs/scaling.md, StarPU-MPI internals, Schedule)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import pipeline_schedule_sim as sim  # noqa: E402

# per micro-batch at 4 micro-batches (ms): the forwards-first Gantt chart's
COST = dict(F0=85.0, F1=246.0, H=410.0, B1=440.0, B0=155.0)


def scaled(M):
    return {k: v * 4 / M for k, v in COST.items()}


def test_one_micro_batch_is_its_route():
    span, busy = sim.simulate(1, 1, 1, "fwd", COST)
    assert span == pytest.approx(sum(COST.values()))
    assert busy == pytest.approx([(85 + 410 + 155) / span, (246 + 440) / span])


@pytest.mark.parametrize("M", [4, 8, 16])
def test_forwards_first_needs_no_more_than_2s_sets(M):
    """eager (forwards first, 2 S = 4 sets) is as short as every micro-batch its own sets,
    and shorter than 1f1b (backward first, S = 2 sets) with balanced stages."""
    eager = sim.simulate(M, 4, 4, "fwd", scaled(M))[0]
    assert eager == pytest.approx(sim.simulate(M, M, M, "fwd", scaled(M))[0])
    assert eager < 0.95 * sim.simulate(M, 2, 2, "bwd", scaled(M))[0]


def test_a_stage_never_runs_two_tasks_at_once():
    """The step is at least each stage's work, and at least one micro-batch's route."""
    for policy in ("ready", "bwd", "fwd"):
        span, busy = sim.simulate(6, 2, 2, policy, scaled(6))
        assert max(busy) <= 1.0 + 1e-12
        assert span >= sum(scaled(6).values()) - 1e-9
