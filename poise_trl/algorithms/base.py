"""The algorithm registry and the seams every poise-trl algorithm uses in TRL's GRPOTrainer.

An algorithm is one module that registers (`register_algorithm`) its config, trainer, callbacks, run-folder
files, memory-plan items and `poise compare` series; `build`, `train`, `run_folder`, `plan` and `compare`
name no algorithm (docs/architecture.md). `CountingGRPOTrainer` counts the generation budget;
`AdvantageTrainer` lets a subclass replace TRL's advantages before TRL's shuffle.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from poise_trl.algorithms.completions import (
    COMPLETIONS_FILE,
    CompletionTable,
    into_trl_table,
    per_completion_advantages,
    truncate_after,
)
from poise_trl.core.distributed import summed_over_processes
from poise_trl.tasks import by_task_means

TASK_REWARD_PREFIX = "rewards/task/"


def task_reward_key(task: str) -> str:
    return f"{TASK_REWARD_PREFIX}{task}/mean"


def record_task_rewards(metrics: dict[str, list], tasks: list[str], rewards: list[float]) -> None:
    """Each task's mean reward over one batch, into a trainer's `_metrics[mode]`; the trainer's `log` averages
    them over the logging window like its other metrics. A task with no row in the batch adds nothing."""
    for task, mean in by_task_means(tasks, rewards).items():
        metrics[task_reward_key(task)].append(mean)


def checkpoint_folder(output_dir: str | os.PathLike, step: int) -> Path:
    """The checkpoint the Trainer writes at `step` (`checkpoint-<step>`): every side-state file and
    marker goes there."""
    return Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


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
    ALGORITHMS[name] = Algorithm(name, config_class, trainer_class, display_name, description, **declared)
    return ALGORITHMS[name]


class TrainerContract:
    """What `poise train`, the callbacks and `poise compare` rely on in every trainer (first in the bases):

    - its algorithm's callbacks (`add_run_callbacks`);
    - counters (`init_counters`): `generated_tokens`, `generated_rollouts` (the budget units),
      `policy_forward_passes` and `pending_logs` (values for the step's log entry);
    - `save_side_state(checkpoint)` / `load_side_state(checkpoint)`, called by TRL's save and load;
    - no TRL model card: `poise train` writes its own into final/.
    """

    def init_counters(self) -> None:
        self.generated_tokens = 0
        self.generated_rollouts = 0
        self.policy_forward_passes = 0
        self.pending_logs: dict[str, float] = {}

    def add_run_callbacks(self) -> None:
        """The callbacks of the trainer's registered algorithm (`Algorithm.callbacks`: POISE's probe report, the
        critics' report), so a trainer built in a user's script writes the reports `poise train` writes. The
        algorithm is the most specific one whose config and trainer classes this trainer's are."""
        matches = [algorithm for algorithm in ALGORITHMS.values()
                   if isinstance(self, algorithm.trainer_class) and isinstance(self.args, algorithm.config_class)]
        algorithm = max(matches, key=lambda a: (len(a.config_class.__mro__), len(a.trainer_class.__mro__)),
                        default=None)
        self.run_callbacks = [make(self, self.args.output_dir) for make in (algorithm.callbacks if algorithm else ())]
        for callback in self.run_callbacks:
            self.add_callback(callback)

    def save_side_state(self, checkpoint: Path) -> None:
        """Write what the trainer keeps beside TRL's checkpoint (probe, critics, streams)."""

    def load_side_state(self, checkpoint: Path) -> None:
        """Restore what `save_side_state` wrote."""

    def create_model_card(self, *args, **kwargs) -> None:
        """TRL writes its generic card ("trained with GRPO") at every save; see the class docstring."""

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            self.save_side_state(checkpoint_folder(self._get_output_dir(trial=trial), self.state.global_step))

    def _issue_warnings_after_load(self, load_result) -> None:
        """A tied LM head is not saved (it is the embedding), and transformers 5 reports it missing on every
        resume; only keys that are really missing are reported."""
        tied = {name for name, _ in self.model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in self.model.named_parameters()}
        missing = [key for key in load_result.missing_keys if key not in tied]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_side_state(Path(checkpoint))
            if self.accelerator.is_main_process:  # the state is the checkpoint's: later steps get generated again
                truncate_after(Path(self.args.output_dir) / COMPLETIONS_FILE, self.state.global_step)


class CountingGRPOTrainer(TrainerContract, GRPOTrainer):
    """TRL's GRPOTrainer plus exact global counts of the completion tokens and rollouts generated.

    Every round counts, DAPO's dropped ones included; the counts go into every log entry. Callbacks put values
    for the step's log entry in `pending_logs` (a separate `log()` would take the step's TRL metrics with it).
    With `log_completions: true` every round goes into the completion table (`algorithms.completions`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_counters()
        self.add_run_callbacks()
        self.completion_table = (CompletionTable(self.args.output_dir, self.accelerator.is_main_process)
                                 if self.args.log_completions else None)
        self.table_columns: dict[str, list] = {}  # this round's extra columns, over all processes

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        # Forward passes of the policy, with and without grad: how POISE shows that its features
        # ride on a pass every algorithm makes.
        if model is self.model:
            self.policy_forward_passes += 1
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Called once per generation round, after truncation at EOS.
        if self.model.training:
            tokens, rollouts = summed_over_processes(
                self.accelerator, [sum(len(ids) for ids in completion_ids_list), len(completion_ids_list)])
            self.generated_tokens += int(tokens)
            self.generated_rollouts += int(rollouts)
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._round_rewards = self._logged_rewards(rewards_per_func)
        self.table_columns = {}
        if "task" in inputs[0]:
            tasks = gather_object([row["task"] for row in inputs])
            record_task_rewards(self._metrics["train" if self.model.training else "eval"], tasks, self._round_rewards)
            self.table_columns["task"] = tasks
        return rewards_per_func

    def _logged_rewards(self, rewards_per_func: torch.Tensor) -> list[float]:
        """The reward TRL logs as `reward` (all processes' rows): weighted sum over functions, NaN where every
        function said None."""
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards.tolist()

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.replace_advantages(output)
            if self.completion_table is not None:
                self._record_completions(output)
        return output

    def replace_advantages(self, output: dict) -> None:
        """Where a subclass puts its own advantages into a training round's `output`; TRL's stay here."""

    def _record_completions(self, output: dict) -> None:
        local = per_completion_advantages(output["advantages"], output["completion_mask"])
        advantages = self.accelerator.gather(local).tolist()
        n = len(advantages)  # TRL has just appended this round's gathered prompts and completions to `_logs`
        prompts, completions = list(self._logs["prompt"])[-n:], list(self._logs["completion"])[-n:]
        into_trl_table(self._logs, advantages, self.table_columns)
        self.completion_table.add_round(self.state.global_step + 1, prompts, completions, self._round_rewards,
                                        advantages, self.table_columns)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            logs = {**logs, **self.pending_logs,
                    "generated_tokens": self.generated_tokens, "generated_rollouts": self.generated_rollouts}
            self.pending_logs = {}
        super().log(logs, start_time)
        if self.completion_table is not None:
            self.completion_table.flush()


class AdvantageTrainer(CountingGRPOTrainer):
    """GRPOTrainer whose advantages come from `compute_advantages` (a subclass hook)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._step_rewards_per_func = rewards_per_func
        self._step_inputs = inputs
        return rewards_per_func

    def replace_advantages(self, output: dict) -> None:
        per_func = self._step_rewards_per_func
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        advantages = self.compute_advantages(rewards, output)
        self._log_advantages(advantages, output["completion_mask"])
        output["advantages"] = advantages

    def compute_advantages(self, rewards: torch.Tensor, output: dict) -> torch.Tensor:
        """Advantages for this process's rows, (B_local,) or (B_local, T), from all rows' rewards (B_global,).

        `rewards` is in generation order: consecutive runs of `num_generations` rows share a prompt.
        """
        raise NotImplementedError

    def check_groups_stay_on_one_process(self, consequence: str) -> None:
        """Whole prompt groups must be generated on one process (rows of a group are consecutive)."""
        rows = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"each process generates {rows} rows per round (per_device_train_batch_size x steps_per_generation), "
                f"not a multiple of num_generations={self.num_generations}: {consequence}. "
                "Make it a multiple of num_generations."
            )

    def local_rows(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of a tensor gathered over processes (TRL's process_slice)."""
        n_local = global_tensor.shape[0] // self.accelerator.num_processes
        start = self.accelerator.process_index * n_local
        return global_tensor[start : start + n_local]

    def _log_advantages(self, advantages: torch.Tensor, completion_mask: torch.Tensor) -> None:
        # Per-token advantages select a different number of tokens on each rank: gather sums,
        # which have one shape everywhere, not the ragged selections.
        values = advantages.float() if advantages.dim() == 1 else advantages[completion_mask.bool()].float()
        stats = torch.stack([values.new_tensor(float(values.numel())), values.sum(), values.pow(2).sum()])
        count, total, squares = summed_over_processes(self.accelerator, stats)
        mean = total / max(count, 1.0)
        variance = (squares - count * mean**2) / (count - 1) if count > 1 else 0.0
        self._metrics["train"]["advantages/mean"].append(mean)
        self._metrics["train"]["advantages/std"].append(max(variance, 0.0) ** 0.5)


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
