"""The model: GPT-2's configuration and parameter layout (`config.py`) and a run's
whole state, parameters and AdamW moments (`state.py`). Nothing here needs StarPU."""
