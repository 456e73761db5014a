"""The algorithms: recipe `algo` name -> config class, trainer class and how to name it.

Each trainer module registers its algorithms at its bottom (`register_algorithm`) and is listed in
`TRAINER_MODULES`; an algorithm's defining settings are its config's field defaults. An algorithm from
outside the package is named by import path, `algo: my_algos:MyAlgorithm`, where `MyAlgorithm` is what its
module's `register_algorithm` call returned. Nothing here imports torch or TRL until an algorithm is asked
for, so a recipe's file and arguments are checked first (`poise_trl.run.recipe`).
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING

from poise_trl.core.loading import RecipeError, import_from_path

if TYPE_CHECKING:
    from poise_trl.algorithms.base import Algorithm

TRAINER_MODULES = ("baselines", "poise", "asyppo", "dapo", "reinforce_pp", "a2po")


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name (the built-in ones and any registered from outside so far)."""
    for module in TRAINER_MODULES:
        importlib.import_module(f"poise_trl.algorithms.{module}")
    from poise_trl.algorithms.base import ALGORITHMS  # noqa: PLC0415 (torch and TRL load only when asked for)

    return ALGORITHMS


def get_algorithm(name: str) -> Algorithm:
    """A registered name (`poise`), or an import path `module:attribute` to an `Algorithm`."""
    known = algorithms()
    if ":" in name:
        found = import_from_path(name, "algo")
        if found not in known.values():
            raise RecipeError(f"algo {name!r} is a {type(found).__name__}, not a registered algorithm: name what "
                              "`register_algorithm(...)` returned in that module")
        return found
    base = name.removesuffix("_process")
    if name not in known and base in known:
        raise RecipeError(f"algo {name!r} is gone: process rewards are a switch of every algorithm, so write "
                          f"`algo: {base}` with `process_rewards: true`")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"unknown algo {name!r}{hint} (known: {', '.join(sorted(known))}, or an import path "
                          "module:Algorithm)")
    return known[name]


__all__ = ["algorithms", "get_algorithm"]
