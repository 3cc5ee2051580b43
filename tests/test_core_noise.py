"""experiments/core_noise.py: what a step balanced over the cores keeps of their mean speed."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "experiments", "core_noise.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import core_noise  # noqa: E402


def test_balance_factor_is_the_slowest_cores_mean_over_the_cores_mean():
    # two cores taking turns at being slow: each window runs at the slower one's 60
    rates = np.array([[100.0, 60.0, 100.0, 60.0],
                      [60.0, 100.0, 60.0, 100.0]])
    rep = core_noise.report(rates)
    assert rep["balance_factor"] == pytest.approx(60 / 80)
    assert rep["correlation"] == pytest.approx(-1.0)
    assert rep["mean_gflops"] == [80.0, 80.0]
    assert rep["cv"] == [0.25, 0.25]
    # cores whose speeds move together lose nothing to balance
    same = np.array([[100.0, 60.0, 80.0], [100.0, 60.0, 80.0]])
    assert core_noise.report(same)["balance_factor"] == 1.0


def test_measures_every_core_and_writes_its_windows(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "--seconds", "0.6", "--window", "0.2",
                        "--cores", str(min(os.sched_getaffinity(0))), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["cores"] == 1 and rep["windows"] == 3 and rep["mean_gflops"][0] > 0
    rows = (tmp_path / "core_noise.csv").read_text().splitlines()
    assert rows[0] == "core,window,gflops" and len(rows) == 4
    assert json.loads((tmp_path / "core_noise.json").read_text())["windows"] == 3


def test_refuses_a_run_shorter_than_two_windows():
    p = subprocess.run([sys.executable, SCRIPT, "--seconds", "1", "--window", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--seconds must hold at least two --window" in p.stderr
