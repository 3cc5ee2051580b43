"""The task flow: one training step as a sequence of layer operations (`taskflow.py`, `step.py`)
on named tensor groups (`tensors.py`), submitted as StarPU tasks (`engine.py`) on the handles
of `handles.py`, each task at the site plan/sites.py gives it (who owns what: plan/topology.py),
or run as plain kernel calls by the reference engine (`reference.py`)."""
