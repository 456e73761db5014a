"""The callbacks of every run: held-out accuracy against compute (with an optional generation budget),
a rich progress display, and the marker that makes a checkpoint complete."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from poise_trl.algorithms.base import BudgetHolder
from poise_trl.core.provenance import write_json
from poise_trl.engines.generation import colocated_vllm, evaluate_accuracy, training_engine
from poise_trl.evaluation.agent import AgentEngine, Toolbox
from poise_trl.run.run_folder import write_checkpoint_marker
from poise_trl.seam.trainer import checkpoint_folder

LEDGER_FILE = "heldout_ledger.json"
HELD_OUT_CONVERSATIONS = 16  # held-out tool-calling conversations played at once, each with its environment worker


@dataclass(frozen=True)
class Budget:
    """Stop training once `amount` generated `unit`s ("tokens": completion tokens, "rollouts")
    were spent, evaluating at each of `points` equal fractions of it."""

    unit: str
    amount: int
    points: int = 4

    def __post_init__(self):
        if self.unit not in ("tokens", "rollouts"):
            raise ValueError(f"budget unit must be 'tokens' or 'rollouts', got {self.unit!r}")
        if self.amount < 1 or self.points < 1:
            raise ValueError(f"a budget needs amount >= 1 and points >= 1, got {self.amount} and {self.points}")

    def points_reached(self, spent: int) -> int:
        return min(self.points, spent * self.points // self.amount)


class HeldOutEvalCallback(BudgetHolder):
    """Held-out Avg@k accuracy against the compute spent to reach it.

    Evaluates at the start, every `every` steps, at each budget point and at the end; each point records the
    step, the generated tokens and rollouts and `train_seconds` (optimizer steps only). With a `budget`,
    training stops once it is spent. Curve, clock and counters are checkpointed, so a resumed run continues.
    """

    def __init__(self, dataset, tokenizer, every: int, num_samples: int, temperature: float,
                 max_new_tokens: int, batch_size: int, seed: int, budget: Budget | None = None,
                 resume_from: str | None = None, toolbox: Toolbox | None = None):
        self.dataset = dataset
        self.toolbox = toolbox  # with tools: whole conversations, as TRL's tool loop plays a training rollout
        self.tokenizer = tokenizer
        self.every = every
        self.sample_kwargs = dict(num_samples=num_samples, temperature=temperature, max_new_tokens=max_new_tokens)
        self.batch_size = batch_size
        self.seed = seed
        self.budget = budget
        self.resume_from = resume_from
        self.history: list[dict] = []
        self.train_seconds = 0.0
        self.budget_points_done = 0
        self.wall_clock_before = 0.0  # seconds of the earlier segments of a resumed run
        self.resumed_at_steps: list[int] = []
        self._segment_started = time.time()
        self._step_started: float | None = None
        self.first_step = 0
        self.trainer = None  # set by train.py: the generation counters and logging live there

    # -- compute spent ----------------------------------------------------------------------------

    def spent(self, unit: str) -> int:
        return getattr(self.trainer, f"generated_{unit}", 0) if self.trainer is not None else 0

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.spent(self.budget.unit) >= self.budget.amount

    def _evaluates_here(self, state) -> bool:
        """The main process evaluates; every process does when sharded weights generate (a collective)."""
        if state.is_world_process_zero:
            return True
        trainer = self.trainer
        if trainer is None or colocated_vllm(trainer) is not None:
            return False
        return trainer.is_fsdp_enabled or is_deepspeed_zero3_enabled()

    def _run_evaluation(self, state, model, **extra) -> None:
        if self.history and self.history[-1]["step"] == state.global_step:
            self.history[-1].update(extra)
            return
        if self.trainer is not None:
            model = self.trainer.accelerator.unwrap_model(model)  # DDP's wrapper has no generate()
        started = time.time()
        # The run's seed samples every evaluation: differences between points come from the policy, not
        # the draw; runs of other seeds draw afresh, arms of one seed share it (`poise compare` pairs them).
        engine = training_engine(self.trainer, model, self.tokenizer, self.batch_size)
        if self.toolbox is not None:  # each conversation holds an environment instance: a pool's worth at a time
            engine = AgentEngine(engine, self.toolbox, self.dataset.to_list(), chunk=HELD_OUT_CONVERSATIONS)
        result = evaluate_accuracy(engine, self.dataset, seed=self.seed, keep_per_prompt=True, **self.sample_kwargs)
        result.update(step=state.global_step, generated_tokens=self.spent("tokens"),
                      generated_rollouts=self.spent("rollouts"), train_seconds=round(self.train_seconds, 3),
                      seconds=round(time.time() - started, 2), **extra)
        self.history.append(result)

    def _push_weights_to_engine(self) -> None:
        """On EVERY process before an evaluation: give the colocated engine this step's weights, once."""
        if colocated_vllm(self.trainer) is not None:
            self.trainer.push_weights_to_engine()

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def wall_clock_seconds(self) -> float:
        return self.wall_clock_before + time.time() - self._segment_started

    def _ledger(self) -> dict:
        return {"history": self.history, "train_seconds": self.train_seconds,
                "budget_points_done": self.budget_points_done,
                "generated_tokens": self.spent("tokens"), "generated_rollouts": self.spent("rollouts"),
                "wall_clock_seconds": self.wall_clock_seconds, "resumed_at_steps": self.resumed_at_steps}

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            write_json(checkpoint_folder(args.output_dir, state.global_step) / LEDGER_FILE,
                       self._ledger())

    def budget_spent_in(self, checkpoint: str) -> bool:
        path = Path(checkpoint) / LEDGER_FILE
        if self.budget is None or not path.exists():
            return False
        return json.loads(path.read_text())[f"generated_{self.budget.unit}"] >= self.budget.amount

    def restore(self, checkpoint: str) -> None:
        path = Path(checkpoint) / LEDGER_FILE
        if not path.exists():
            if self.budget is not None:
                raise FileNotFoundError(
                    f"checkpoint {checkpoint} has no {LEDGER_FILE}: the tokens, rollouts and seconds spent before it "
                    "are unknown, so a budgeted run cannot resume from it. Start the run afresh."
                )
            warnings.warn(f"{checkpoint} has no {LEDGER_FILE}: generation counts and the held-out curve restart "
                          "from zero", stacklevel=2)
            return
        ledger = json.loads(path.read_text())
        self.history = ledger["history"]
        self.train_seconds = ledger["train_seconds"]
        self.budget_points_done = ledger["budget_points_done"]
        # Ledgers written before the wall clock was recorded: the training seconds are its lower bound.
        self.wall_clock_before = ledger.get("wall_clock_seconds", self.train_seconds)
        self.resumed_at_steps = [*ledger.get("resumed_at_steps", []), int(Path(checkpoint).name.rsplit("-", 1)[1])]
        self._segment_started = time.time()
        if self.trainer is not None:
            self.trainer.generated_tokens = ledger["generated_tokens"]
            self.trainer.generated_rollouts = ledger["generated_rollouts"]

    # -- training events ----------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.first_step = state.global_step  # after a resume: the checkpoint's step
        self._segment_started = time.time()
        if self.resume_from:
            self.restore(self.resume_from)
        if not self.history:
            self._push_weights_to_engine()
            if self._evaluates_here(state):
                self._run_evaluation(state, model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._step_started is not None:
            self.train_seconds += time.perf_counter() - self._step_started
            self._step_started = None
        evaluate = bool(self.every) and state.global_step % self.every == 0
        if self.budget is not None:
            # Every process sees the same global counts, so all stop at the same step.
            reached = self.budget.points_reached(self.spent(self.budget.unit))
            if reached > self.budget_points_done:
                self.budget_points_done = reached
                evaluate = True
            if self.budget_reached:
                control.should_training_stop = True
                control.should_save = args.save_strategy != "no"  # a rerun then finds the run finished
        if not evaluate:
            return
        control.should_log = True  # on every process: logging gathers the loss
        self._push_weights_to_engine()
        if self._evaluates_here(state):
            extra = {"budget_point": self.budget_points_done} if self.budget is not None else {}
            self._run_evaluation(state, model, **extra)
            if self.trainer is not None:
                self.trainer.pending_logs["heldout/accuracy"] = self.history[-1]["accuracy"]

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._push_weights_to_engine()
        if self._evaluates_here(state):
            self._run_evaluation(state, model)
        if self.toolbox is not None:
            self.toolbox.close()

    @property
    def latest(self) -> dict | None:
        return self.history[-1] if self.history else None


class RichProgressCallback(TrainerCallback):
    """One live line: progress in steps (or in generated tokens/rollouts under a budget),
    reward, held-out accuracy, elapsed and ETA (replaces tqdm)."""

    def __init__(self, eval_callback: HeldOutEvalCallback | None = None, console: Console | None = None):
        self.eval_callback = eval_callback
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None
        self.task = None
        self.reward: float | None = None

    @property
    def _budget(self) -> Budget | None:
        return self.eval_callback.budget if self.eval_callback else None

    def _fields(self, state) -> dict:
        acc = self.eval_callback.latest if self.eval_callback else None
        fields = {
            "step": state.global_step,
            "reward": "-" if self.reward is None else f"{self.reward:.3f}",
            "heldout": "-" if acc is None else f"{acc['accuracy']:.3f}",
        }
        if self._budget is not None:
            fields["completed"] = min(self.eval_callback.spent(self._budget.unit), self._budget.amount)
        else:
            fields["completed"] = state.global_step
        return fields

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        budget = self._budget
        position = ("[bold]train[/] step {task.fields[step]}/{task.total}" if budget is None
                    else f"[bold]train[/] step {{task.fields[step]}}, {budget.unit} {{task.completed}}/{{task.total}}")
        self.progress = Progress(
            TextColumn(position),
            BarColumn(),
            TextColumn("reward {task.fields[reward]}  held-out acc {task.fields[heldout]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        total = state.max_steps if budget is None else budget.amount
        self.task = self.progress.add_task("train", total=total, **self._fields(state))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.reward = logs["reward"]

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, **self._fields(state))

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, **self._fields(state))
            self.progress.stop()
            self.progress = None


class CheckpointMarkerCallback(TrainerCallback):
    """Marks a checkpoint complete once everything else is in it (the Trainer's files, the
    ledger, the probe state): added after every other callback. A checkpoint without the
    marker was interrupted while it was written, and a rerun resumes from the one before."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = checkpoint_folder(args.output_dir, state.global_step)
            write_checkpoint_marker(folder, state.global_step)
