"""`starpu-llm generate`: a prompt continued by a model read from an llm.c checkpoint, the
text printed as it comes (the decode flow itself is flow/generate.py); `starpu-llm eval`:
HellaSwag's accuracy of such a model (training/hellaswag.py scores it)."""
from __future__ import annotations

import sys

import numpy as np

from .errors import StarpuLLMError
from .flow.generate import (Decoder, DirectBackend, Generating, StarPUBackend, check_request,
                             generate)
from .io import hf, tokenizer
from .plan.partition import ENGINES, PartitionRequest
from .plan.settings import check_fields
from .runtime.starpu import Runtime, resolve_here
from .training import hellaswag


def _print(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def read_text_model(init_from, command: str):
    """(config, parameters) of the model init_from (io/hf.read_model: an llm.c checkpoint, a
    Hugging Face folder, a Hub name in the local cache) for `command`: a clear error for a
    model without GPT-2's vocabulary (the text goes through the GPT-2 tokenizer). The engine
    is checked before, with the partition (resolve_here)."""
    config, params = hf.read_model(init_from)
    if config.V != tokenizer.N_VOCAB:
        raise StarpuLLMError(f"{init_from} has a vocabulary of {config.V} tokens, not GPT-2's "
                             f"{tokenizer.N_VOCAB}: {command} reads and writes text with the "
                             f"GPT-2 tokenizer; give the checkpoint of a GPT-2-vocabulary model")
    return config, params


def run_generate(init_from, prompt: str = "",
                 max_new_tokens: int = Generating.max_new_tokens,
                 temperature: float = Generating.temperature, top_k: int = Generating.top_k,
                 seed: int = Generating.seed, engine: str = ENGINES[0], write=_print,
                 runtime=None, request=None, top_p: float = Generating.top_p) -> str:
    """`starpu-llm generate`: continues the text prompt (empty: from <|endoftext|>) with the
    llm.c checkpoint init_from, a model of GPT-2's vocabulary, sampling with a numpy Generator
    seeded with seed (flow/generate.sample: temperature, top_k, top_p). Writes the prompt, then the text as it is produced, then a newline, to
    `write`; returns the generated text. The StarPU engine runs on `runtime`, or on a runtime
    of its own for the call on the partition of `request` (a partition.PartitionRequest, its
    flags serve's: --gpus runs the decode steps on GPUs; None: the default partition)."""
    partition = None            # the flags checked first, unless a runtime is given to run on
    if runtime is None or engine != "starpu":
        partition = resolve_here(request or PartitionRequest(), engine=engine)
    config, params = read_text_model(init_from, "generate")
    tok = tokenizer.gpt2()
    ids = tok.encode(prompt) if prompt else [tok.eot]
    check_fields(Generating(seed=seed))                  # the others: check_request's
    check_request(config, len(ids), max_new_tokens, temperature, top_k, top_p)  # before start-up
    own_runtime = None
    if engine == "starpu" and runtime is None:
        runtime = own_runtime = Runtime(partition)
    try:
        backend = (StarPUBackend(runtime, config, params) if engine == "starpu"
                   else DirectBackend(config, params))
        try:
            write(prompt)
            stream = tokenizer.StreamDecoder(tok, write)
            new = generate(Decoder(backend), ids, max_new_tokens, temperature, top_k,
                           np.random.default_rng(seed), stream, top_p)
            stream.close()
            write("\n")
        finally:
            backend.close()
    finally:
        if own_runtime is not None:
            own_runtime.shutdown()
    return tok.decode(new)


def run_eval(init_from, path: str, limit: int | None = None, B: int = hellaswag.DEFAULT_ROWS,
             engine: str = ENGINES[0], request=None, progress=None) -> hellaswag.Score:
    """The Score of the model init_from on the first `limit` examples of the HellaSwag file at
    path (None: all), B rows a forward, on the engine's backend (the StarPU engine on a
    runtime of its own, on the partition of `request`); progress(rows done, rows) after each
    forward when given."""
    partition = resolve_here(request or PartitionRequest(), engine=engine)  # the flags first
    config, params = read_text_model(init_from, "eval")
    examples = hellaswag.read_examples(path, config, limit)
    runtime = Runtime(partition) if engine == "starpu" else None
    try:
        backend = (StarPUBackend(runtime, config, params) if runtime is not None
                   else DirectBackend(config, params))
        try:
            return hellaswag.evaluate(examples, backend, B, progress)
        finally:
            backend.close()
    finally:
        if runtime is not None:
            runtime.shutdown()


def tenths(label: str):
    """A progress callable that says on stderr each tenth of the rows done."""
    said = [0]

    def progress(done: int, total: int):
        tenth = done * 10 // total
        if tenth > said[0]:
            said[0] = tenth
            print(f"{label}: {done}/{total} rows scored", file=sys.stderr, flush=True)
    return progress
