"""The algorithms: recipe `algo` name -> config class, trainer class and how to name it.

Each trainer module registers its algorithms at its bottom (`register_algorithm`) and is listed in
`TRAINER_MODULES`; an algorithm's defining settings are its config's field defaults.
"""

from __future__ import annotations

import difflib
import importlib

from poise_trl.algorithms.base import ALGORITHMS, Algorithm

TRAINER_MODULES = ("baselines", "poise", "asyppo", "dapo", "reinforce_pp", "a2po")


def _registered() -> dict[str, Algorithm]:
    for module in TRAINER_MODULES:
        importlib.import_module(f"poise_trl.algorithms.{module}")
    return ALGORITHMS


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name."""
    return _registered()


def get_algorithm(name: str) -> Algorithm:
    known = _registered()
    base = name.removesuffix("_process")
    if name not in known and base in known:
        raise ValueError(f"algo {name!r} is gone: process rewards are a switch of every algorithm, so write "
                         f"`algo: {base}` with `process_rewards: true`")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algo {name!r}{hint} (known: {', '.join(sorted(known))})")
    return known[name]


__all__ = ["Algorithm", "algorithms", "get_algorithm"]
