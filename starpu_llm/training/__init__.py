"""Training: the run's settings and loop (`trainer.py`), what it starts from and what a
resumed run keeps (`resume.py`), its engine and partition (`engines.py`), what watches
each step (`watchers.py`, `metrics.py`, `sampler.py`, `validation.py`), the files it
writes (`checkpointing.py`) and the learning-rate schedule (`schedule.py`)."""
