"""`starpu-llm generate`: a prompt continued by a model read from an llm.c checkpoint, the
text printed as it comes (the decode flow itself is flow/generate.py)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .errors import StarpuLLMError
from .flow.generate import Decoder, DirectBackend, StarPUBackend, check_request, generate
from .io import hf, tokenizer
from .plan.partition import ENGINES, PartitionRequest
from .runtime.starpu import Runtime, resolve_here


@dataclass(frozen=True)
class Generating:
    """`starpu-llm generate`'s defaults, each stated here once: cli.py builds the flags (their
    defaults and the numbers in their help) from these, run_generate's keywords default to
    them (no prompt is "": the text starts from <|endoftext|>). The sampling's defaults leave
    the model's distribution as it is (temperature 1, no top-k or top-p cut)."""
    max_new_tokens: int = 64
    # the sampling (flow/generate.sample)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1337


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
