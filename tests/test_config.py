"""The named GPT-2 configurations: their dimensions, their parameter counts against the
closed form of llm.c's layout and against GPT-2's published sizes, and `--model` accepting
them. Layout only: nothing here allocates a model larger than a few KB."""
import argparse

import pytest

from starpu_llm.cli import build_parser
from starpu_llm.model.config import MODELS, ParamLayout

# name, its GPT-2 release's name, (L, NH, C), the size OpenAI published (GPT-2 paper and model
# cards: 124M, 355M, 774M, 1558M = "1.5B")
GPT2_SIZES = [
    ("d12", "gpt2", (12, 12, 768), 124e6),
    ("d24", "gpt2-medium", (24, 16, 1024), 355e6),
    ("d36", "gpt2-large", (36, 20, 1280), 774e6),
    ("d48", "gpt2-xl", (48, 25, 1600), 1558e6),
]


def closed_form_count(L, C, Vp, maxT):
    """GPT-2's parameters counted tensor by tensor from the layout: per layer ln1 (2C), qkv
    (3C*C + 3C), attention projection (C*C + C), ln2 (2C), fc (4C*C + 4C), fc projection
    (4C*C + C), i.e. 12C^2 + 13C; then wte (Vp*C, padded rows included as llm.c counts them),
    wpe (maxT*C) and the final layernorm (2C)."""
    return 12 * L * C * C + 13 * L * C + Vp * C + maxT * C + 2 * C


@pytest.mark.parametrize("name, alias, dims, published", GPT2_SIZES)
def test_gpt2_sizes(name, alias, dims, published):
    config = MODELS[name]
    assert MODELS[alias] == config
    assert (config.L, config.NH, config.C) == dims
    assert (config.maxT, config.V, config.Vp) == (1024, 50257, 50304)
    assert config.C // config.NH == 64          # every GPT-2 has heads of 64 channels
    L, NH, C = dims
    count = closed_form_count(L, C, Vp=50304, maxT=1024)
    assert config.num_parameters == ParamLayout(config).total == count
    assert abs(count - published) <= 0.01 * published, (name, count, published)


def test_closed_form_counts():
    """The formula's counts, worked out by hand (llm.c prints 124475904 as GPT-2 124M's
    num_parameters)."""
    assert [closed_form_count(L, C, 50304, 1024) for _, _, (L, _, C), _ in GPT2_SIZES] == \
        [124_475_904, 354_871_296, 774_090_240, 1_557_686_400]


def test_every_model_flag_accepts_the_gpt2_sizes():
    """Every subcommand with --model offers all the MODELS names (the new sizes included)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    with_model = {cmd: next(a for a in sub._actions if a.dest == "model")
                  for cmd, sub in subparsers.choices.items()
                  if any(a.dest == "model" for a in sub._actions)}
    assert {"train", "bench", "predict"} <= set(with_model)
    for cmd, action in with_model.items():
        assert set(action.choices) == set(MODELS), cmd
        for name, alias, _, _ in GPT2_SIZES:
            for model in (name, alias):
                assert parser.parse_args([cmd, "--model", model]).model == model
