"""Predict before running: the recorded task graph of a step (graph.py), a per-codelet cost
model calibrated on this machine (calibrate.py, machine.py, model.py), a list scheduler that
replays the graph on a partition (simulate.py), and the prediction (predict.py); and one
configuration run in a fresh process, what calibration, autotuner, bench and experiments
share (perf/runs.py)."""
