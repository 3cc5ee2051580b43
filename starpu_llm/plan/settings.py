"""A setting of a run: a dataclass field whose metadata also makes it a command-line flag
(cli.py builds the flags of `train`, `bench` and `predict` from these fields: one spelling)."""
from __future__ import annotations

from dataclasses import field


def setting(default, help: str | None = None, *, short: str | None = None,
            check: str | None = None, choices=None, metavar: str | None = None,
            group: str | None = None, ranks_agree: bool = False, sweep: bool = False):
    """A field. With `help` it is also the flag --<name with dashes>: `short` option, `check`
    (cli._CHECKS: "positive": a whole number >= 1, "nonneg": a finite number >= 0, ...),
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
