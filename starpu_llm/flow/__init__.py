"""The task flow: one training step as a sequence of layer operations (`taskflow.py`, `step.py`)
on named tensor groups (`tensors.py`), submitted as StarPU tasks (`ops.py`, `engine.py`) on
handles registered and placed by `placement.py`, or run as plain kernel calls by the reference
engine (`reference.py`)."""
