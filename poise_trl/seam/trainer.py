"""The seam to transformers' `Trainer`, shared by every TRL trainer poise-trl adapts: counters, side state
saved and restored beside each checkpoint, the step's log entry, metrics.

Events an algorithm implements: `save_side_state(checkpoint)`, `load_side_state(checkpoint)`.
Helpers it calls: `log_metric(name, value)`, `init_counters()`, `load_checkpoint_weights(checkpoint)`.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from poise_trl.core.completions import COMPLETIONS_FILE, CompletionTable, truncate_after
from poise_trl.tasks import by_task_means

TASK_REWARD_PREFIX = "rewards/task/"


def checkpoint_folder(output_dir: str | os.PathLike, step: int) -> Path:
    """The checkpoint the Trainer writes at `step` (`checkpoint-<step>`): every side-state file and
    marker goes there."""
    return Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


class TrainerSeam:
    """What `poise train`, the callbacks and `poise compare` rely on in every trainer (first in the bases):

    - counters (`init_counters`): `generated_tokens`, `generated_rollouts` (the budget units),
      `policy_forward_passes` and `pending_logs` (values for the step's log entry), the completion table and the
      algorithm's callbacks (`run_callbacks`);
    - `save_side_state(checkpoint)` / `load_side_state(checkpoint)`, called by the Trainer's save and load;
    - no TRL model card: `poise train` writes its own into final/.
    """

    run_callback_classes: tuple = ()  # the algorithm's callbacks (set by `register_algorithm`)

    def init_counters(self) -> None:
        """Counters, the completion table and the algorithm's callbacks (made with the trainer and its output
        folder; `poise train` tells them the checkpoint it resumes from)."""
        self.run_callbacks = [make(self, self.args.output_dir) for make in self.run_callback_classes]
        for callback in self.run_callbacks:
            self.add_callback(callback)
        self.generated_tokens = 0
        self.generated_rollouts = 0
        self.policy_forward_passes = 0
        self.pending_logs: dict[str, float] = {}
        self.completion_table = (CompletionTable(self.args.output_dir, self.accelerator.is_main_process)
                                 if self.args.log_completions else None)

    # -- events -------------------------------------------------------------------------------

    def save_side_state(self, checkpoint: Path) -> None:
        """Write what the trainer keeps beside TRL's checkpoint (probe, critics, streams)."""

    def load_side_state(self, checkpoint: Path) -> None:
        """Restore what `save_side_state` wrote."""

    # -- helpers ------------------------------------------------------------------------------

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids that end a completion: TRL 1.16's `eos_token_ids` (the generation config's too); TRL 1.14 stops
        at the tokenizer's EOS alone."""
        ids = getattr(self, "eos_token_ids", None)
        return list(ids) if ids is not None else [self.processing_class.eos_token_id]

    @property
    def mode(self) -> str:
        return "train" if self.model.training else "eval"

    def log_metric(self, name: str, value: float, mode: str = "train") -> None:
        """One value of a metric of `mode` ("train", or "eval" where code runs in evaluation too); the Trainer's
        `log` averages a logging window's values."""
        self._metrics[mode][name].append(value)

    def log_task_rewards(self, tasks: list[str], rewards: list[float]) -> None:
        """Each task's mean reward over one batch (`rewards/task/<task>/mean`), averaged over the logging window
        like the other metrics. A task with no row in the batch adds nothing."""
        for task, mean in by_task_means(tasks, rewards).items():
            self.log_metric(f"{TASK_REWARD_PREFIX}{task}/mean", mean, self.mode)

    def load_checkpoint_weights(self, checkpoint: str) -> None:
        """The model weights of `checkpoint`, without training a step (a resumed run with nothing left to do)."""
        self._load_from_checkpoint(checkpoint)

    def create_model_card(self, *args, **kwargs) -> None:
        """TRL writes its generic card ("trained with GRPO") at every save; see the class docstring."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            logs = {**logs, **self.pending_logs,
                    "generated_tokens": self.generated_tokens, "generated_rollouts": self.generated_rollouts}
            self.pending_logs = {}
        super().log(logs, start_time)
        if self.completion_table is not None:
            self.completion_table.flush()

    # -- the Trainer's private methods --------------------------------------------------------

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
