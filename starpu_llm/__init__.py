"""starpu_llm: GPT-2 (llm.c's 124M CPU trainer) trained as a StarPU task graph from Python.

    from starpu_llm import TrainConfig, train
    result = train(TrainConfig(model="d12", batch=4, seq_len=64, steps=10))

The compiled part (kernels, codelets, cffi binding) is loaded on first use of what needs it
(the names below; `starpu_llm.io`'s file formats and data tools do not).
"""
from . import signals as _signals

_signals.at_start_up()        # first: the command ends cleanly on a signal from here on

import importlib  # noqa: E402

from .errors import StarpuLLMError  # noqa: E402

_LAZY = {   # imported on first use: `import starpu_llm` loads no numpy (signals.py says why)
    "MODELS": "model.config", "GPTConfig": "model.config", "ParamLayout": "model.config",
    "AdamW": "model.config",
    "TrainConfig": "training.trainer", "TrainResult": "training.trainer", "train": "training.trainer",
    "TrainState": "model.state", "Runtime": "runtime",
    "StarPUEngine": "flow.engine", "ReferenceEngine": "flow.reference",
}


_COMPILED = ("starpu_llm._clib", "starpu_llm._kernels", "libstarpu")


def compiled_part_missing(e: ImportError) -> str | None:
    """What to do when e is the compiled part failing to load (not built, or a library it was
    linked against not found on this machine: a wheel built elsewhere); None for another
    ImportError."""
    if not any(part in f"{e.name} {e}" for part in _COMPILED):
        return None
    return (f"the compiled part (the cffi binding and the libraries it was built against: "
            f"StarPU's, the BLAS's), which did not load ({e}): build it with `make`, or `pip "
            f"install --no-build-isolation -e .` where pkg-config finds StarPU "
            f"(docs/clusters.md); a wheel needs those libraries where it runs (README, \"Build, "
            f"StarPU 1.4, clusters\")")


def __getattr__(name):
    if name == "__version__":     # stated once, in meson.build; the build writes it
        from ._build import VERSION
        return VERSION
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ImportError as e:
            missing = compiled_part_missing(e)
            if missing is None:
                raise
            raise ImportError(f"starpu_llm.{name} needs {missing}") from e
        return getattr(module, name)
    raise AttributeError(f"module 'starpu_llm' has no attribute {name!r}")


__all__ = ["StarpuLLMError", *_LAZY]
