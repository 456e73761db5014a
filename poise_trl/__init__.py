"""poise-trl: single-node RL with verifiable rewards on top of TRL.

The package root is the library's API, as `trl` is TRL's: every registered algorithm's config and trainer
(`POISEConfig`, `POISETrainer`, `AsyPPOConfig`, ...), used like TRL's `GRPOConfig` / `GRPOTrainer`, and
`register_algorithm` with `GRPOSeam`, the base of a trainer of one's own (docs/library.md). They load on
first use, so `import poise_trl` stays cheap and the `poise` commands check their arguments before torch and
TRL load.
"""

__version__ = "0.1.0"


def _exports() -> dict:
    from poise_trl.algorithms import algorithms  # noqa: PLC0415 (torch and TRL load on first use)
    from poise_trl.algorithms.base import register_algorithm  # noqa: PLC0415 (as above)
    from poise_trl.seam.grpo import GRPOSeam  # noqa: PLC0415 (as above)

    found = {"register_algorithm": register_algorithm, "GRPOSeam": GRPOSeam}  # the base of an algorithm of one's own
    for algorithm in algorithms().values():
        found.update({cls.__name__: cls for cls in (algorithm.config_class, algorithm.trainer_class)})
    return found


def __getattr__(name: str):
    if name.startswith("__"):  # dunder probes (copy, pickle, doctest) are not exports
        raise AttributeError(name)
    exports = _exports()
    if name not in exports:
        raise AttributeError(f"module 'poise_trl' has no attribute {name!r} (it exports {', '.join(sorted(exports))})")
    return exports[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *_exports()])
