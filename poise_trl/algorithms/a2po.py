"""A*-PO (arXiv 2505.20686; TRL's `trl.experimental.a2po.A2POTrainer`), counted like the GRPO-based arms.

`CountingA2POTrainer` (on the seam's `A2POSeam`) adds the counters `poise train` / `poise compare` read (both
stages' generation counts in the budget), per-task rewards, and checkpoints that hold V* and the filtered train
set.
Transformers generation only; LoRA is refused. Details: docs/algorithms.md ("A*-PO").
"""

from __future__ import annotations

import json
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import get_last_checkpoint
from trl.data_utils import maybe_apply_chat_template
from trl.import_utils import suppress_experimental_warning

with suppress_experimental_warning():  # as TRL's own imports of trl.experimental; the registry says "experimental"
    from trl.experimental.a2po import A2POConfig

from poise_trl.algorithms.base import BudgetHolder, Signal, logged, register_algorithm, setting
from poise_trl.core.distributed import summed_over_processes
from poise_trl.core.loading import RecipeError
from poise_trl.core.provenance import write_json
from poise_trl.seam.a2po import A2POSeam

A2PO_STATE_FILE = "a2po_state.json"
ZERO_TARGET_TOLERANCE = 1e-6


@dataclass
class A2POArmConfig(A2POConfig):
    """TRL's A2POConfig as `poise train` builds it. A*-PO's defining settings are TRL's defaults (beta1
    0.5, beta2 1e-3, 8 value samples, all-wrong prompts filtered); the recipe sets the rest."""

    log_completions: bool = setting(False, "Append every training completion to completions.jsonl at each log: "
                                           "prompt, completion, reward, baseline V*(x) and advantage r - V*(x) (and "
                                           "the task on a task mix). TRL's A2POTrainer has no tracker table.")


def completion_lengths(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """(B, T) generated ids (prompt removed) -> tokens up to and including the first EOS (T where none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    return torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completion_ids.shape[1])


@contextmanager
def recording_generate(model, on_output):
    """Calls `on_output(sequences, prompt_width)` after every `model.generate` inside the block."""
    own = vars(model).get("generate")  # an instance-level generate someone else installed
    original = model.generate

    def generate(*args, **kwargs):
        output = original(*args, **kwargs)
        prompt = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        on_output(output, prompt.shape[1])
        return output

    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


class CountingA2POTrainer(A2POSeam):
    """TRL's A2POTrainer with poise-trl's counters, budget checks and resumable stage 1."""

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 peft_config=None, callbacks=None, optimizers=(None, None)):
        if peft_config is not None:
            raise ValueError("algo a2po does not support LoRA (peft): TRL's A2POTrainer trains the full model against "
                             "a frozen full copy; remove the `peft` section from the recipe")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.init_counters()
        self.stage1_tokens: int | None = None  # None until stage 1 ran (or came back from a checkpoint)
        self.stage1_rollouts: int | None = None
        self.stage1_seconds: float | None = None
        self.zero_signal_rollouts = 0
        callback = self._eval_callback()
        if callback is not None and callback.budget is not None and self.train_dataset is not None:
            self._check_stage1_fits(callback.budget)  # here: `poise train` has written nothing yet

    # -- helpers ------------------------------------------------------------------------------------

    def _eval_callback(self) -> BudgetHolder | None:
        """The run's budget holder (the held-out evaluation, in `poise train`)."""
        return next((c for c in self.callback_handler.callbacks if isinstance(c, BudgetHolder)), None)

    def _prompt_text(self, example) -> str:
        return maybe_apply_chat_template(example, self.processing_class)["prompt"]

    # -- stage 1 ------------------------------------------------------------------------------------

    def _check_stage1_fits(self, budget) -> None:
        """Before sampling: what is certain is an error, what only may happen a warning."""
        n, prompts = self.args.num_value_samples, len(self.train_dataset)
        rollouts, fix = prompts * n, "lower dataset_size or num_value_samples, or raise the budget"
        if budget.unit == "rollouts" and rollouts >= budget.amount:
            raise RecipeError(f"A*-PO stage 1 needs {rollouts} rollouts ({prompts} prompts x num_value_samples={n}), "
                              f"but budget_rollouts is {budget.amount}, leaving nothing to train: {fix}")
        if budget.unit == "tokens":
            if rollouts >= budget.amount:  # at least one token per completion
                raise RecipeError(f"A*-PO stage 1 generates at least {rollouts} tokens ({prompts} prompts x "
                                  f"num_value_samples={n}), but budget_tokens is {budget.amount}: {fix}")
            bound = rollouts * self.args.max_completion_length
            if bound >= budget.amount:
                warnings.warn(f"A*-PO stage 1 may use up to {bound} of the {budget.amount} budget tokens ({prompts} "
                              f"prompts x num_value_samples={n} x max_completion_length="
                              f"{self.args.max_completion_length}); it stops with an error as soon as it passes the "
                              "budget", stacklevel=3)

    def run_stage1(self, estimate):
        callback = self._eval_callback()
        budget = callback.budget if callback is not None else None
        tokens = rollouts = 0
        started = time.perf_counter()
        prompts = len(self.train_dataset)

        def count(sequences, prompt_width):
            nonlocal tokens, rollouts
            lengths = completion_lengths(sequences[:, prompt_width:], self.stop_token_ids)
            tokens += int(lengths.sum())
            rollouts += lengths.numel()
            # One process: stop at the first batch past the budget rather than after all of stage 1
            # (with several, each process only knows its share until the gather below).
            if budget is not None and self.accelerator.num_processes == 1:
                spent = getattr(self, f"generated_{budget.unit}") + (tokens if budget.unit == "tokens" else rollouts)
                if spent >= budget.amount:
                    done = rollouts // self.args.num_value_samples
                    raise RecipeError(
                        f"A*-PO stage 1 alone overruns the budget: {spent} generated {budget.unit} after {done} of "
                        f"{prompts} prompts (about {round(spent * prompts / done)} for all), budget_{budget.unit} is "
                        f"{budget.amount}: lower dataset_size or num_value_samples, or raise the budget"
                    )

        generator = self.accelerator.unwrap_model(self.ref_model)  # what TRL's unwrap_model_for_generation yields
        with recording_generate(generator, count):
            estimate()
        self.stage1_seconds = time.perf_counter() - started
        if callback is not None:
            # Stage 1 runs before the Trainer's first step, where the callback's clocks do not run:
            # its seconds are training compute, on the curve's time axis like its tokens.
            callback.train_seconds += self.stage1_seconds
            callback.wall_clock_before += self.stage1_seconds
        self.stage1_tokens, self.stage1_rollouts = summed_over_processes(self.accelerator, [tokens, rollouts])
        self.generated_tokens += self.stage1_tokens
        self.generated_rollouts += self.stage1_rollouts
        self.zero_signal_rollouts += self.stage1_rollouts
        self.pending_logs.update({"a2po/stage1_tokens": self.stage1_tokens,
                                  "a2po/stage1_rollouts": self.stage1_rollouts,
                                  "a2po/stage1_prompts_kept": len(self.train_dataset),
                                  "a2po/stage1_seconds": round(self.stage1_seconds, 3)})
        if len(self.train_dataset) == 0:
            raise ValueError("A*-PO stage 1: every reference sample of every train prompt was wrong, so "
                             "filter_all_incorrect dropped the whole train set: use a stronger starting model, more "
                             "num_value_samples, or filter_all_incorrect: false")
        if budget is not None:
            spent = getattr(self, f"generated_{budget.unit}")
            if spent >= budget.amount:
                raise RecipeError(f"A*-PO stage 1 alone used {spent} generated {budget.unit} of a budget of "
                                  f"{budget.amount}, leaving nothing to train: lower dataset_size or "
                                  "num_value_samples, or raise the budget")

    # -- stage 2 ------------------------------------------------------------------------------------

    def on_stage2_batch(self, inputs, output):
        if self.model.training:
            completion_ids = output["input_ids"][:, -output["logits_to_keep"]:]
            lengths = completion_lengths(completion_ids, self.stop_token_ids)
            zero = (output["rewards"] - output["v_star"]).abs() < ZERO_TARGET_TOLERANCE
            tokens, rollouts, zero_signal = summed_over_processes(
                self.accelerator, [int(lengths.sum()), lengths.numel(), int(zero.sum())])
            self.generated_tokens += tokens
            self.generated_rollouts += rollouts
            self.zero_signal_rollouts += zero_signal
            self.log_metric("zero_signal_fraction", zero_signal / rollouts)
            if self.completion_table is not None:
                self._record_completions(inputs, output, completion_ids)
        if "task" in inputs[0]:  # this process's rows, as TRL's A2PO logs its `reward`
            self.log_task_rewards([row["task"] for row in inputs], output["rewards"].tolist())

    def _record_completions(self, inputs: list[dict], output: dict, completion_ids: torch.Tensor) -> None:
        """A*-PO's row of the completion table: its baseline is V*(x), its advantage r - V*(x) (Eq. 3)."""
        prompt_ids = output["input_ids"][:, : -output["logits_to_keep"]]
        prompts = self.processing_class.batch_decode(prompt_ids, skip_special_tokens=True)
        completions = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        rewards, v_star = (self.accelerator.gather(output[key]).tolist() for key in ("rewards", "v_star"))
        columns = {"baseline": v_star}
        if "task" in inputs[0]:
            columns["task"] = gather_object([row["task"] for row in inputs])
        self.completion_table.add_round(self.state.global_step + 1, gather_object(prompts), gather_object(completions),
                                        rewards, [r - v for r, v in zip(rewards, v_star, strict=True)], columns)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            self.policy_forward_passes += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            logs = {**logs, "zero_signal_rollouts": self.zero_signal_rollouts}
        super().log(logs, start_time)

    # -- checkpoints --------------------------------------------------------------------------------

    def _a2po_state(self) -> dict:
        return {
            "optimal_values": self.optimal_values,  # keyed by the chat-templated prompt, as TRL keys them
            "train_prompts": [self._prompt_text(example) for example in self.train_dataset],  # after the filter
            "stage1_tokens": self.stage1_tokens,
            "stage1_rollouts": self.stage1_rollouts,
            "stage1_seconds": self.stage1_seconds,
            "generated_tokens": self.generated_tokens,
            "generated_rollouts": self.generated_rollouts,
            "zero_signal_rollouts": self.zero_signal_rollouts,
            "num_value_samples": self.args.num_value_samples,
            "beta1": self.args.beta1,
            "filter_all_incorrect": self.args.filter_all_incorrect,
        }

    def save_side_state(self, checkpoint: Path) -> None:
        write_json(checkpoint / A2PO_STATE_FILE, self._a2po_state())

    # Stage 1's state is restored by `train` (`restore_stage1`) before TRL's own train builds the dataloader
    # from the filtered train set: load_side_state, called later, has nothing left to do.

    def restore_stage1(self, checkpoint: str | Path) -> None:
        """V*, the filtered train set and the counters of a checkpoint; stage 1 is not run again."""
        path = Path(checkpoint) / A2PO_STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {checkpoint} has no {A2PO_STATE_FILE} (A*-PO's V* and filtered train "
                                    "set): it was not written by the a2po trainer; start the run afresh")
        state = json.loads(path.read_text())
        for key in ("num_value_samples", "beta1", "filter_all_incorrect"):
            if state[key] != getattr(self.args, key):
                raise ValueError(f"checkpoint {checkpoint} estimated V* with {key}={state[key]}, this run has "
                                 f"{getattr(self.args, key)}: resume with the same settings or start afresh")
        wanted = state["train_prompts"]
        keep = set(wanted)
        texts = [self._prompt_text(example) for example in self.train_dataset]
        kept = [i for i, text in enumerate(texts) if text in keep]
        if [texts[i] for i in kept] != wanted or not keep <= state["optimal_values"].keys():
            raise ValueError(f"checkpoint {checkpoint} holds A*-PO state for another train set (dataset, "
                             "dataset_size or seed differ): resume with the same settings or start afresh")
        self.train_dataset = self.train_dataset.select(kept)
        self.optimal_values = state["optimal_values"]
        self.stage1_tokens, self.stage1_rollouts = state["stage1_tokens"], state["stage1_rollouts"]
        self.stage1_seconds = state["stage1_seconds"]
        # HeldOutEvalCallback's ledger sets the same totals again at train begin, when it is there.
        self.generated_tokens, self.generated_rollouts = state["generated_tokens"], state["generated_rollouts"]
        self.zero_signal_rollouts = state["zero_signal_rollouts"]

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Before TRL's train(): it runs stage 1 when V* is unknown, and the Trainer builds its
        # dataloader from the (filtered) train set before it loads anything from the checkpoint.
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if checkpoint and self.optimal_values is None:
            self.restore_stage1(checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)


def zero_signal_share(train_log: list[dict]) -> float | None:
    """A run's zero-signal share with its stage-1 rollouts (V* estimation), which carry no policy-gradient
    signal either."""
    counted = [entry for entry in train_log if "zero_signal_rollouts" in entry]
    return counted[-1]["zero_signal_rollouts"] / counted[-1]["generated_rollouts"] if counted else None


register_algorithm("a2po", A2POArmConfig, CountingA2POTrainer, "A*-PO",
                   "A*-PO (TRL experimental): offline V* from reference samples, 1 rollout per prompt",
                   card="A*-PO: optimal value V* estimated offline from reference samples, one rollout per prompt",
                   signals={"zero_signal_fraction": Signal(
                       "zero-signal rollouts (r - V* = 0)", "zero-signal", logged("zero_signal_fraction"),
                       zero_signal_share)})
