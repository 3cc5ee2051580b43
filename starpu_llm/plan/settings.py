"""A setting of a run: a dataclass field whose metadata also makes it a command-line flag
(cli.py builds the flags of `train`, `bench` and `predict` from these fields: one spelling),
and the checks of its value, the same for a flag's text (cli.py) and for a value given from
Python (check_fields: TrainConfig, PartitionRequest)."""
from __future__ import annotations

import math
import os
from dataclasses import field, fields
from numbers import Integral, Real
from typing import Callable, NamedTuple

from ..errors import StarpuLLMError, opt


def setting(default, help: str | None = None, *, short: str | None = None,
            check: str | None = None, choices=None, metavar: str | None = None,
            group: str | None = None, ranks_agree: bool = False, sweep: bool = False):
    """A field. With `help` it is also the flag --<name with dashes> (the help says its default
    as %(default)s, or %(default)g for a number: help_of): `short` option, `check`
    (a key of CHECKS: "positive": a whole number >= 1, "nonneg": a finite number >= 0, ...),
    `choices`, `metavar`, help `group`. `ranks_agree`: every MPI rank must have the same value
    (trainer.run_settings). `sweep`: `bench` and `predict` take a comma-separated list of
    values (each value as `train` takes it), one configuration each."""
    meta = dict(help=help, short=short, check=check, choices=choices, metavar=metavar,
                group=group)
    meta = {k: v for k, v in meta.items() if v is not None}
    if ranks_agree:
        meta["ranks_agree"] = True
    if sweep:
        meta["sweep"] = True
    return field(default=default, metadata=meta)


class Check(NamedTuple):
    parse: Callable          # a flag's text -> the value (ValueError: not of the kind)
    kind: str                # what the text must be ("a whole number")
    is_kind: Callable        # whether a Python value is of that kind
    ok: Callable             # whether a value of the kind keeps the rule
    rule: str                # the rule ("at least 1")


def _whole(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _int_or_auto(s):
    return s if s == "auto" else int(s)


def _int_list(s):
    return [int(x) for x in s.split(",")]


CHECKS = {
    "positive": Check(int, "a whole number", _whole, lambda v: v >= 1, "at least 1"),
    "positive_or_auto": Check(_int_or_auto, "a whole number or auto",
                              lambda v: v == "auto" or _whole(v),
                              lambda v: v == "auto" or v >= 1, "at least 1, or auto"),
    "positive_list": Check(_int_list, "whole numbers separated by commas",
                           lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                           and all(_whole(x) for x in v),
                           lambda v: min(v) >= 1, "at least 1 each"),
    "nonneg": Check(float, "a number", _number, lambda v: math.isfinite(v) and v >= 0,
                    "a finite number >= 0"),
    "positive_number": Check(float, "a number", _number,
                             lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "nonneg_int": Check(int, "a whole number", _whole, lambda v: v >= 0, ">= 0"),
    "probability": Check(float, "a number", _number, lambda v: 0 < v <= 1, "in (0, 1]"),
    "unit": Check(float, "a number", _number, lambda v: 0 <= v < 1, "in [0, 1)"),
    "port": Check(int, "a port number", _whole, lambda v: 0 <= v < 65536, "in 0..65535"),
}


def help_of(f) -> str:
    """A setting's help as --help shows it: its default where the text says %(default)s (or
    %(default)g, a number's shortest form), the field's own, so that no second copy of it is
    written in the text (TrainConfig's docstring; argparse fills the same for --help)."""
    return f.metadata["help"] % {"default": f.default}


def check_fields(obj) -> None:
    """Each setting of the dataclass obj not at its default holds what its flag would take:
    its check's kind and rule, one of its choices, a bool for a switch, text (or a path) for
    a name or path: else one StarpuLLMError naming the field (a flag in the CLI's words). From
    Python, before anything starts: a wrong type otherwise fails deep inside, or not at all
    (True taken as a batch of 1)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "help" not in f.metadata or value is None or (type(value) is type(f.default)
                                                         and value == f.default):
            continue
        check_field(f, value)


def check_setting(cls, name: str, value) -> None:
    """value for the setting `name` of the dataclass cls, checked as check_fields does (the
    server's sampling fields: serve/api.py)."""
    (f,) = [f for f in fields(cls) if f.name == name]
    check_field(f, value)


def check_field(f, value) -> None:
    """check_fields' rule for one setting f (a dataclass field) and its value."""
    m = f.metadata
    if "check" in m:
        c = CHECKS[m["check"]]
        if not c.is_kind(value):
            raise StarpuLLMError(f"{opt(f.name)} expects {c.kind}, got {value!r}")
        if not c.ok(value):
            raise StarpuLLMError(f"{opt(f.name)} must be {c.rule}, got {value!r}")
    elif "choices" in m:
        if not isinstance(value, str) or value not in m["choices"]:
            raise StarpuLLMError(f"{opt(f.name)} {value!r}: choose one of "
                                 f"{', '.join(map(str, m['choices']))}")
    elif isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise StarpuLLMError(f"{opt(f.name)} is a switch: True or False, got {value!r}")
    elif str(f.type).startswith("str"):
        # text, or a path; a size may be a number of bytes (memory_limit: str | int | float)
        kinds = ((str, os.PathLike) + ((Integral,) if "int" in str(f.type) else ())
                 + ((Real,) if "float" in str(f.type) else ()))
        if not isinstance(value, kinds) or isinstance(value, bool) or not str(value).strip():
            raise StarpuLLMError(f"{opt(f.name)} expects text (a path, a name, a size; not "
                                 f"empty), got {value!r}")
