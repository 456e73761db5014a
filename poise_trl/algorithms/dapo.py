"""DAPO (arXiv 2503.14476) on GRPOTrainer: clip-higher (0.2 / 0.28), TRL's token-level loss, overlong
reward shaping (Eq. 13) and dynamic sampling (Sec. 3.2, Eq. 11).

TRL has no dynamic sampling: each round calls TRL's `_generate_and_score_completions` on a further batch
of prompts and the kept groups are merged into one batch before TRL's shuffle; every process runs the same
rounds. `dynamic_sampling_fill` fills the slots left at the round cap. Details: docs/algorithms.md ("DAPO").
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from trl import GRPOConfig
from trl.trainer.utils import pad

from poise_trl.algorithms.base import DAPOLoss, PromptStream, Signal, register_algorithm, setting
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.core.provenance import write_json
from poise_trl.seam.grpo import GRPOSeam

FILL_MODES = ("drop", "zero_variance")
DAPO_STATE_FILE = "dapo_state.json"
PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # left-padded; every other (B, W) tensor is right-padded


@dataclass
class DAPOConfig(ProcessRewardArguments, DAPOLoss, GRPOConfig):
    """GRPOConfig plus DAPO's dynamic sampling and overlong reward shaping."""

    dynamic_sampling: bool = setting(True, "Drop groups that are all correct or all wrong (DAPO Eq. 11) and generate "
                                           "more prompts instead.")
    max_generation_rounds: int = setting(4, "Cap on generation rounds per batch (1 = no extra rounds).")
    dynamic_sampling_fill: str = setting("drop", "When the cap is hit short of kept groups: 'drop' (train on the "
                                                 "kept groups only, the others get zero loss weight) or "
                                                 "'zero_variance' (train on dropped groups too, GRPO-like).")
    correct_reward_threshold: float = setting(1.0, "A rollout is correct for the dynamic-sampling filter when the "
                                                   "FIRST reward function (the verifier, e.g. math_accuracy) gives "
                                                   "at least this.")
    overlong_buffer_length: int | None = setting(None, "L_cache of DAPO's soft overlong punishment: the last this "
                                                       "many tokens before max_completion_length are penalized "
                                                       "linearly. None: max_completion_length // 5 (DAPO's 4096 of "
                                                       "20480); 0: off.")
    overlong_penalty_factor: float = setting(1.0, "Penalty at max_completion_length.")

    def __post_init__(self):
        super().__post_init__()
        if self.max_generation_rounds < 1:
            raise ValueError(f"max_generation_rounds must be >= 1, got {self.max_generation_rounds}")
        if self.dynamic_sampling_fill not in FILL_MODES:
            raise ValueError(f"dynamic_sampling_fill must be one of {FILL_MODES}, got {self.dynamic_sampling_fill!r}")
        if self.overlong_buffer_length is None:
            self.overlong_buffer_length = self.max_completion_length // 5
        if not 0 <= self.overlong_buffer_length <= self.max_completion_length:
            raise ValueError("overlong_buffer_length must be in [0, max_completion_length], got "
                             f"{self.overlong_buffer_length}")


# --- Selection logic (pure) ------------------------------------------------------------


def select_groups(kept: list[bool], target: int, fill: str = "drop") -> tuple[list[int], list[bool]]:
    """The `target` groups that fill the batch, from those generated so far, and whether each is in the loss.

    Kept groups first; at the round cap, dropped groups fill the rest, out of the loss with fill="drop".
    """
    if fill not in FILL_MODES:
        raise ValueError(f"fill must be one of {FILL_MODES}, got {fill!r}")
    chosen = [i for i, ok in enumerate(kept) if ok][:target]
    missing = target - len(chosen)
    flat = [i for i, ok in enumerate(kept) if not ok]
    if len(flat) < missing:
        raise ValueError(f"only {len(kept)} groups generated for a target of {target}")
    return chosen + flat[:missing], [True] * len(chosen) + [fill == "zero_variance"] * missing


def needs_another_round(informative_per_process: torch.Tensor, target: int, rounds_done: int, max_rounds: int) -> bool:
    """(num_processes, groups so far) bool -> whether all processes run one more round."""
    return rounds_done < max_rounds and bool((informative_per_process.sum(dim=1) < target).any())


def merge_batches(outputs: list[dict], rows: list[tuple[int, int]], pad_token_id: int) -> dict:
    """One TRL generation output from rows (output index, row index) of several.

    Prompt tensors left-padded, completion-width tensors right-padded to the widest selected row; (B,), (B, 1)
    tensors and length-B lists are indexed; `num_items_in_batch` is recomputed by the caller.
    """
    merged = {}
    for key, first in outputs[0].items():
        if key == "num_items_in_batch":
            continue
        if first is None:
            merged[key] = None
        elif isinstance(first, list):
            merged[key] = [outputs[b][key][r] for b, r in rows]
        elif isinstance(first, torch.Tensor) and first.dim() >= 1:
            picked = [outputs[b][key][r] for b, r in rows]
            if first.dim() == 1:
                merged[key] = torch.stack(picked)
            else:
                value = pad_token_id if key.endswith("_ids") else 0
                side = "left" if key in PROMPT_KEYS else "right"
                merged[key] = pad(picked, padding_value=value, padding_side=side)
        else:
            raise ValueError(f"cannot merge generation output {key!r} of type {type(first).__name__}")
    return merged


# --- Trainer ---------------------------------------------------------------------------


class OverlongShapedAdvantages:
    """GRPO advantages on overlong-shaped rewards (Eq. 13), on either seam (`GRPOSeam`, `AsyncGRPOSeam`)."""

    @staticmethod
    def off_policy_conflict(config) -> str | None:
        if config.dynamic_sampling:
            return ("its rollout worker streams prompts, and DAPO's dynamic sampling needs a round to draw more "
                    "into: set dynamic_sampling: false (clip-higher, the token-level loss and overlong shaping run "
                    "so)")
        return None

    def compute_advantages(self, rewards, output):
        cfg = self.args
        if cfg.overlong_buffer_length > 0:
            penalty = estimators.overlong_penalty(
                self.round.completion_lengths, cfg.max_completion_length, cfg.overlong_buffer_length,
                cfg.overlong_penalty_factor,
            ).to(rewards.device)
            self.log_metric("dapo/overlong_penalty_mean", penalty.mean().item())
            self.log_metric("dapo/overlong_penalized_frac", (penalty < 0).float().mean().item())
            rewards = rewards + penalty
        return self.local_rows(estimators.group_normalized_advantages(rewards, self.num_generations))


class DAPOTrainer(OverlongShapedAdvantages, ProcessRewardMixin, GRPOSeam):
    """GRPO advantages on overlong-shaped rewards, with dynamic sampling of groups with 0 < #correct < G."""

    async_events = OverlongShapedAdvantages  # with dynamic sampling off

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.dynamic_sampling and not (
            hasattr(self.train_dataset, "__getitem__") and hasattr(self.train_dataset, "__len__")
        ):
            raise ValueError("DAPO's dynamic sampling draws extra prompts by index: it needs a map-style train "
                             "dataset")
        self._extra_prompts = None
        self.extra_batches_drawn = 0  # position of the extra-prompt stream, saved with checkpoints
        self.dynamic_sampling_history: list[dict] = []

    # -- dynamic sampling -----------------------------------------------------------------------

    def collect_round(self, inputs):
        if not self.args.dynamic_sampling:
            return self.score_round(inputs)
        group_size, n_proc, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        target = len(inputs) // group_size
        outputs, kept = [], []
        batch = inputs
        while True:
            outputs.append(self.score_round(batch))
            # The first reward function is the verifier (DAPO Eq. (11)); (num_processes, groups this round):
            # global rewards come in process order.
            correct = self.round.rewards_per_func[:, 0] >= self.args.correct_reward_threshold
            kept.append(estimators.dapo_keep_groups(correct, group_size).view(n_proc, -1).cpu())
            so_far = torch.cat(kept, dim=1)
            if not needs_another_round(so_far, target, len(outputs), self.args.max_generation_rounds):
                break
            batch = self._next_extra_batch(len(inputs))
        fill = self.args.dynamic_sampling_fill
        plans = [select_groups(so_far[p].tolist(), target, fill) for p in range(n_proc)]
        groups_per_round = kept[0].shape[1]
        groups, in_loss = plans[rank]
        rows = [(g // groups_per_round, (g % groups_per_round) * group_size + j)
                for g in groups for j in range(group_size)]
        merged = merge_batches(outputs, rows, self.processing_class.pad_token_id)
        tool_mask = merged.get("tool_mask")
        if not all(in_loss):
            # TRL's loss mask is completion_mask * tool_mask: zero on the rows of groups out of the loss.
            weight = torch.tensor(in_loss, device=merged["completion_mask"].device).repeat_interleave(group_size)
            tool_mask = torch.ones_like(merged["completion_mask"]) if tool_mask is None else tool_mask
            tool_mask = merged["tool_mask"] = tool_mask * weight.unsqueeze(1).to(tool_mask.dtype)
        loss_mask = merged["completion_mask"] if tool_mask is None else merged["completion_mask"] * tool_mask
        merged["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._log_dynamic_sampling(so_far, plans, target, len(outputs))
        return merged

    def _next_extra_batch(self, rows: int) -> list[dict]:
        if self._extra_prompts is None:
            # A fresh stream, fast-forwarded past the batches served before a resume; + 1 on the
            # seed: not the order of TRL's sampler.
            self._extra_prompts = PromptStream(
                len(self.train_dataset), rows // self.num_generations, self.accelerator.num_processes,
                self.accelerator.process_index, seed=self.args.seed + 1, start=self.extra_batches_drawn,
            )
        mine = next(self._extra_prompts)
        self.extra_batches_drawn += 1
        return [self.train_dataset[i] for i in mine for _ in range(self.num_generations)]

    # -- checkpoints ----------------------------------------------------------------------------

    def save_side_state(self, checkpoint: Path) -> None:
        # Every process draws the same number of extra batches (rounds are collective).
        write_json(checkpoint / DAPO_STATE_FILE, {"extra_batches_drawn": self.extra_batches_drawn})

    def load_side_state(self, checkpoint: Path) -> None:
        state_file = checkpoint / DAPO_STATE_FILE
        if state_file.exists():
            self.extra_batches_drawn = json.loads(state_file.read_text())["extra_batches_drawn"]
        elif self.args.dynamic_sampling:
            raise FileNotFoundError(
                f"checkpoint {checkpoint} has no DAPO state ({DAPO_STATE_FILE}): it was not written by DAPOTrainer, "
                "or was copied without it. Resuming would restart the extra-prompt stream of dynamic sampling and "
                "draw prompts the run has already used; start a fresh run instead, or resume from a DAPO checkpoint."
            )
        else:
            warnings.warn(f"checkpoint {checkpoint} has no {DAPO_STATE_FILE}: the extra-prompt stream starts at 0 "
                          "(unused while dynamic sampling is off)", stacklevel=2)
            self.extra_batches_drawn = 0
        self._extra_prompts = None

    def _log_dynamic_sampling(self, kept: torch.Tensor, plans: list[tuple[list[int], list[bool]]], target: int,
                              rounds: int) -> None:
        """Global counts (the same on every process): informative (Eq. 11), trained, zero-weight, dropped."""
        generated = int(kept.numel())
        trained = sum(sum(in_loss) for _, in_loss in plans)
        trained_informative = sum(int(kept[p, [g for g, w in zip(groups, in_loss, strict=True) if w]].sum())
                                  for p, (groups, in_loss) in enumerate(plans))
        record = {
            "step": self.state.global_step,
            "rounds": rounds,
            "generated_groups": generated,
            "informative_groups": int(kept.sum()),
            "first_round_informative": int(kept[:, :target].sum()),
            "trained_groups": trained,
            "zero_weight_groups": target * len(plans) - trained,
            "zero_variance_trained": trained - trained_informative,
            "dropped_groups": generated - trained,
            "generated_rollouts": generated * self.num_generations,
            "trained_rollouts": trained * self.num_generations,
        }
        self.dynamic_sampling_history.append(record)
        for key in ("rounds", "generated_groups", "informative_groups", "trained_groups", "zero_weight_groups",
                    "dropped_groups", "zero_variance_trained"):
            self.log_metric(f"dapo/{key}", float(record[key]))
        if record["trained_rollouts"]:
            self.log_metric("dapo/generated_per_trained", record["generated_rollouts"] / record["trained_rollouts"])


def dropped_fraction(entry: dict) -> float | None:
    generated = entry.get("dapo/generated_groups")
    return entry["dapo/dropped_groups"] / generated if generated else None


def zero_signal_groups(entry: dict) -> float | None:
    """Every generated group counts, the dropped ones included (TRL's share sees only the kept ones)."""
    generated = entry.get("dapo/generated_groups")
    return (generated - entry["dapo/informative_groups"]) / generated if generated else None


DAPO_LINE = "DAPO: clip-higher, token-level loss, overlong shaping, dynamic sampling"
register_algorithm("dapo", DAPOConfig, DAPOTrainer, "DAPO", DAPO_LINE, card=DAPO_LINE,
                   signals={"dapo/dropped_fraction": Signal("DAPO dropped-group fraction", "DAPO dropped",
                                                            dropped_fraction),
                            "zero_signal_fraction": Signal("zero-signal groups", "zero-signal",
                                                           zero_signal_groups)})
