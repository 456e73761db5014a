"""The algorithm registry and what algorithms share beyond the TRL seam (`poise_trl.seam`).

An algorithm is one module that registers (`register_algorithm`) its config, trainer, callbacks, run-folder
files, memory-plan items and `poise compare` series; `build`, `train`, `run_folder`, `plan` and `compare`
name no algorithm (docs/architecture.md). Its trainer subclasses a seam class (`GRPOSeam`, `A2POSeam`) and
implements the seam's events.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback


class BudgetHolder(TrainerCallback):
    """The callback that holds a run's generation budget (`budget`: a unit and an amount, or None) and its
    clocks (`train_seconds`, `wall_clock_before`): how a trainer that generates before the Trainer's first step
    (A*-PO's stage 1) checks and charges the budget. `poise train` attaches `run.callbacks.HeldOutEvalCallback`."""

    budget = None
    train_seconds = 0.0
    wall_clock_before = 0.0


class RunCallback(TrainerCallback):
    """A callback an algorithm attaches to each run; `finish` ends a resumed run with nothing left to do."""

    def __init__(self, trainer, output_dir: str, resume_from: str | None = None):
        self.trainer, self.output_dir, self.resume_from = trainer, output_dir, resume_from

    def finish(self, args, state, control) -> None:
        self.on_train_end(args, state, control)

    def summary(self) -> dict:
        return {}

    def closing_note(self) -> str | None:
        """One line `poise train` prints at the end when the run did not do what the algorithm is for."""
        return None


@dataclass(frozen=True)
class Signal:
    """A training-log series `poise compare` shows over training: `value(entry)` reads one log entry
    (None: not in it); `run_mean(train_log)`, when given, replaces the mean of those values for a run."""

    title: str  # plot title
    header: str  # table column
    value: Callable[[dict], float | None]
    run_mean: Callable[[list[dict]], float | None] | None = None


def setting(default, help: str):
    """A config field with its help text, which `poise` and TRL's argument parser show."""
    return field(default=default, metadata={"help": help})


@dataclass
class DAPOLoss:
    """Config mixin: TRL's loss fields at DAPO's values (POISE's reference run uses them too)."""

    epsilon: float = setting(0.2, "Lower clip range.")
    epsilon_high: float | None = setting(0.28, "Upper clip range (clip-higher).")
    loss_type: str = setting("dapo", "Token-level loss: a token mean over the batch.")
    beta: float = setting(0.0, "KL coefficient: no KL term.")


def logged(key: str) -> Callable[[dict], float | None]:
    return lambda entry: entry.get(key)


@dataclass(frozen=True)
class CompareTable:
    """A per-run table of `poise compare`: `columns` maps a log key to (header, how a run reduces its
    values: "last", "mean" or "second_half" (the mean over the second half of its logged steps))."""

    key: str  # where compare.json keeps it in each result
    title: str
    columns: dict[str, tuple[str, str]]
    spread: bool = False  # mean ± std over seeds (else the mean)
    seeds_below_start: bool = False  # a column counting seeds that ended below their start accuracy


@dataclass(frozen=True)
class Algorithm:
    name: str  # the recipe's `algo`
    config_class: type
    trainer_class: type
    display_name: str  # "POISE", "REINFORCE++ w/ Baseline": in error lines and tables
    description: str  # one line: what distinguishes it
    card: str | None = None  # the model card's line on the algorithm; None: the name alone
    min_generations: int = 2  # rollouts per prompt its baseline needs
    min_generations_reason: str = "its baseline comes from the other rollouts of the same prompt"
    callbacks: tuple[type[RunCallback], ...] = ()
    run_files: tuple[str, ...] = ()  # what its callbacks write into the output folder (names or globs)
    # memory_items(value, plan) -> [(name, bytes, note)]: value(key) is the recipe's setting (or the config's
    # default); plan a `plan.PlanView` (inputs, tokens, bytes per value, model shapes).
    memory_items: Callable | None = None
    signals: dict[str, Signal] = field(default_factory=dict)  # log key -> series shown by `poise compare`
    compare_tables: tuple[CompareTable, ...] = ()
    task_mix_settings: dict = field(default_factory=dict)  # config values a task-mix dataset implies


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(name: str, config_class: type, trainer_class: type, display_name: str, description: str,
                       **declared) -> Algorithm:
    """Register algorithm `name`; `declared` sets the other fields of `Algorithm` (callbacks, files, ...). A
    recipe names it `algo: name`, or from outside the package by where the returned value lives,
    `algo: module:attribute` (`algorithms.get_algorithm`)."""
    if name in ALGORITHMS:
        raise ValueError(f"algo {name!r} is registered twice")
    algorithm = ALGORITHMS[name] = Algorithm(name, config_class, trainer_class, display_name, description, **declared)
    # The trainer attaches these itself (`TrainerSeam.run_callback_classes`), so a trainer built in a user's
    # script writes the reports `poise train` writes; algorithms that share a trainer share its callbacks.
    if vars(trainer_class).get("run_callback_classes", algorithm.callbacks) != algorithm.callbacks:
        raise ValueError(f"algo {name!r} declares other callbacks than another algorithm of {trainer_class.__name__}")
    trainer_class.run_callback_classes = algorithm.callbacks
    return algorithm


class PromptStream:
    """Batches of train-set indices beyond TRL's sampler (DAPO's extra rounds, POISE's selection pool).

    A seeded permutation per pass, each process taking its slice as TRL's RepeatSampler does; `start` skips
    the batches served before a resume, so a resumed run draws the prompts the uninterrupted one would have.
    """

    def __init__(self, size: int, prompts_per_process: int, num_processes: int, rank: int, seed: int,
                 start: int = 0):
        per_batch = prompts_per_process * num_processes
        if size < per_batch:
            raise ValueError(f"the train set has {size} prompts, fewer than one batch of extra prompts ({per_batch})")
        self.size, self.prompts_per_process, self.num_processes = size, prompts_per_process, num_processes
        self.rank, self.seed = rank, seed
        self._batches = itertools.islice(self._all_batches(), start, None)

    def _all_batches(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed)
        per_batch, mine = self.prompts_per_process * self.num_processes, self.prompts_per_process
        while True:
            order = torch.randperm(self.size, generator=generator).tolist()
            for start in range(0, len(order) - per_batch + 1, per_batch):
                yield order[start + self.rank * mine : start + (self.rank + 1) * mine]

    def __next__(self) -> list[int]:
        return next(self._batches)
