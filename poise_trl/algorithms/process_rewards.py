"""Training-free process rewards (docs/references.md) as an option for any GRPOTrainer-based algorithm.

Each completion is cut into episodes at discourse markers; V(b) at each boundary is the mean log-probability
of the gold answer after a force-answer prompt, and U_k = V(b_k) - V(b_{k-1}) becomes per-token advantages
(`estimators.process_reward_advantages`) added to the algorithm's own. `ProcessRewardMixin` wraps
`_generate_and_score_completions`. Details: docs/algorithms.md ("Training-free process rewards").
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad

from poise_trl.algorithms.base import setting
from poise_trl.core import estimators
from poise_trl.core.distributed import gather_padded
from poise_trl.tasks.math_grader import answer_to_str

# process-rewards post, "Episode Segmentation" (its list goes on: "... more markers"), plus paragraph breaks.
DEFAULT_MARKERS = ["\n\n", "Wait", "Alternatively", "Actually", "Hmm", "So ", "But ", "Therefore", "Let me ",
                   "I need to "]
THINK_END = "</think>"

# --- Pure functions --------------------------------------------------------------------


def token_pieces(tokenizer) -> list[str]:
    """The text of every vocabulary id decoded on its own: completion text = "".join(pieces[ids])."""
    return tokenizer.batch_decode(
        [[i] for i in range(len(tokenizer))], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _marker_regex(markers: list[str], separators: bool) -> re.Pattern | None:
    """Whitespace-only markers ("\\n\\n") end an episode; word markers ("Wait") start one and
    match only as whole words ("So" is not the start of "Some")."""
    parts = []
    for marker in markers:
        if (marker.strip() == "") != separators:
            continue
        part = re.escape(marker)
        if marker[0].isalnum():
            part = r"(?<![A-Za-z0-9])" + part
        if marker[-1].isalnum():
            part += r"(?![A-Za-z0-9])"
        parts.append(part)
    return re.compile("|".join(parts)) if parts else None


def episode_boundaries(
    pieces: list[str], markers: list[str], max_episode_tokens: int, stop_text: str | None = THINK_END
) -> list[int]:
    """Token indices 0 < b < len(pieces) where a new episode starts; `pieces`: one completion's tokens.

    A whitespace marker puts a boundary after itself, a word marker before its token; only before the first
    `stop_text`. Episodes longer than `max_episode_tokens` are cut every `max_episode_tokens` tokens.
    """
    text = "".join(pieces)
    starts = list(itertools.accumulate((len(p) for p in pieces), initial=0))[:-1]

    def containing(char: int) -> int:  # index of the token that holds text[char]
        return bisect.bisect_right(starts, char) - 1

    stop = text.find(stop_text) if stop_text else -1
    limit = containing(stop) if stop >= 0 else len(pieces)
    found = []
    for separators in (True, False):
        regex = _marker_regex(markers, separators)
        if regex is not None:
            # after a separator: the next token start at or past its end; before a word: its token
            found += [bisect.bisect_left(starts, m.end()) if separators else containing(m.start())
                      for m in regex.finditer(text)]
    marked = sorted({b for b in found if 0 < b <= limit and b < len(pieces)})
    cuts, previous = [], 0
    for end in [*marked, limit]:
        cuts += range(previous + max_episode_tokens, end, max_episode_tokens)  # length fallback
        cuts.append(end)
        previous = end
    cuts.pop()  # the end of the thinking span is a boundary only where a marker put one
    return cuts


def thin_boundaries(boundaries: list[int], max_count: int) -> list[int]:
    """At most `max_count` boundaries, evenly spaced over the list (the last one always kept)."""
    if len(boundaries) <= max_count:
        return boundaries
    step = len(boundaries) / max_count
    return [boundaries[int(len(boundaries) - 1 - i * step)] for i in reversed(range(max_count))]


def process_rewards_from_values(
    values: list[list[float]], boundaries: list[list[int]], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Marginal utilities U_k = V(b_k) - V(b_{k-1}) on token b_k - 1: ((B, width) rewards, 0/1 mask)."""
    rewards = torch.zeros(len(values), width)
    mask = torch.zeros(len(values), width)
    for row, (vals, bounds) in enumerate(zip(values, boundaries, strict=True)):
        if bounds and len(vals) != len(bounds) + 1:
            raise ValueError(f"row {row}: {len(bounds)} boundaries need {len(bounds) + 1} values, got {len(vals)}")
        for k, b in enumerate(bounds, start=1):
            rewards[row, b - 1] = vals[k] - vals[k - 1]
            mask[row, b - 1] = 1.0
    return rewards, mask


@torch.no_grad()
def answer_logprob_means(
    model, sequences: list[list[int]], answer_lengths: list[int], pad_token_id: int, batch_size: int
) -> torch.Tensor:
    """Mean log-probability of the last `answer_lengths[i]` tokens of each sequence, (N,)."""
    device = next(model.parameters()).device
    out = torch.empty(len(sequences))
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        seqs = [torch.tensor(sequences[i]) for i in chunk]
        ids = pad(seqs, padding_value=pad_token_id, padding_side="left").to(device)
        attention = pad([torch.ones_like(s) for s in seqs], padding_value=0, padding_side="left").to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        lengths = torch.tensor([answer_lengths[i] for i in chunk], device=device)
        k = int(lengths.max())
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=k + 1).logits
        logps = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, -k:].unsqueeze(-1)).squeeze(-1)
        is_answer = torch.arange(k, device=device) >= (k - lengths).unsqueeze(1)
        out[chunk] = ((logps * is_answer).sum(1) / lengths).cpu()
    return out


# --- Config and trainer mixins ---------------------------------------------------------


@dataclass
class ProcessRewardArguments:
    """Config mixin of every GRPO-based algorithm: `process_rewards: true` switches them on for any of them."""

    process_rewards: bool = setting(False, "Add training-free process rewards to the outcome advantages.")
    process_reward_markers: list[str] = field(
        default_factory=lambda: list(DEFAULT_MARKERS),
        metadata={"help": "Episode markers: whitespace-only ones end an episode, word markers start one."},
    )
    process_reward_max_episode_tokens: int = setting(256, "Token-length fallback: longer episodes are cut every this "
                                                          "many tokens.")
    process_reward_max_episodes: int = setting(16, "Most boundaries (V evaluations beyond the prompt's) per "
                                                   "completion; evenly thinned.")
    process_reward_force_prompt: str = setting(
        "\n</think>\n\\boxed{", "Appended to each prefix before the gold answer (must match the chat format).")
    process_reward_answer_column: str = setting("answer", "Dataset column with the gold answer.")
    process_reward_coef: float = setting(1.0, "Weight of the normalized process advantage added to the outcome "
                                              "advantage.")
    process_reward_norm: str = setting("group", "'group': normalize process rewards within each prompt group (as the "
                                                "post does); 'batch': over the whole global batch (REINFORCE++'s "
                                                "global normalization).")
    process_reward_batch_size: int | None = setting(None, "Sequences per V forward pass (default: "
                                                          "per_device_train_batch_size).")

    def __post_init__(self):
        if isinstance(self.process_reward_markers, str):
            self.process_reward_markers = [self.process_reward_markers]
        if not self.process_reward_markers or not all(isinstance(m, str) and m for m in self.process_reward_markers):
            raise ValueError(f"process_reward_markers must be non-empty strings, got {self.process_reward_markers!r}")
        if self.process_reward_norm not in ("group", "batch"):
            raise ValueError(f"process_reward_norm must be 'group' or 'batch', got {self.process_reward_norm!r}")
        if self.process_reward_max_episode_tokens < 1 or self.process_reward_max_episodes < 1:
            raise ValueError("process_reward_max_episode_tokens and process_reward_max_episodes must be >= 1")
        if self.process_reward_coef < 0:
            raise ValueError(f"process_reward_coef must be >= 0, got {self.process_reward_coef}")
        super().__post_init__()


class ProcessRewardMixin:
    """Trainer mixin of every GRPO-based algorithm (`class MyTrainer(ProcessRewardMixin, GRPOSeam)`): with
    `process_rewards` on, adds the process advantages to the final `advantages` of every training round."""

    _pieces: list[str] | None = None

    def finish_round(self, output: dict, inputs: list[dict]) -> dict:
        output = super().finish_round(output, inputs)
        if self.args.process_rewards:
            output["advantages"] = self._with_process_advantages(output, inputs)
        return output

    def _with_process_advantages(self, output: dict, inputs: list[dict]) -> torch.Tensor:
        cfg = self.args
        mask = output["completion_mask"]
        outcome = output["advantages"]
        outcome_tokens = outcome.unsqueeze(1).expand_as(mask) if outcome.dim() == 1 else outcome
        outcome_tokens = torch.where(mask.bool(), outcome_tokens, torch.zeros_like(outcome_tokens))
        rewards, reward_mask, values = self._process_rewards(output, inputs)
        device = mask.device
        gathered = [gather_padded(self.accelerator, t.to(device)) for t in (rewards, reward_mask, mask.float())]
        group_size = self.num_generations if cfg.process_reward_norm == "group" else None
        process = estimators.process_reward_advantages(*gathered, group_size=group_size)
        process = self.local_rows(process)[:, : mask.shape[1]].to(outcome_tokens.dtype)
        advantages = outcome_tokens + cfg.process_reward_coef * process
        self._log_process_diagnostics(outcome_tokens, advantages, mask, rewards, reward_mask, values)
        return advantages

    def _process_rewards(self, output: dict, inputs: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Segment, build the force-answer sequences, score V(prefix) in one batched no-grad pass."""
        cfg = self.args
        tokenizer = self.processing_class
        if self._pieces is None:
            self._pieces = token_pieces(tokenizer)
        force_ids = tokenizer(cfg.process_reward_force_prompt, add_special_tokens=False)["input_ids"]
        sequences, answer_lengths, boundaries = [], [], []
        for i, row in enumerate(inputs):
            prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            completion = output["completion_ids"][i][output["completion_mask"][i].bool()].tolist()
            gold = answer_to_str(row.get(cfg.process_reward_answer_column))
            answer = tokenizer(gold, add_special_tokens=False)["input_ids"]
            bounds = []
            if answer and completion:
                bounds = episode_boundaries(
                    [self._pieces[t] for t in completion], cfg.process_reward_markers,
                    cfg.process_reward_max_episode_tokens,
                )
                bounds = thin_boundaries(bounds, cfg.process_reward_max_episodes)
            boundaries.append(bounds)
            for b in [0, *bounds] if bounds else []:
                sequences.append(prompt + completion[:b] + force_ids + answer)
                answer_lengths.append(len(answer))
        scores = torch.empty(0)
        if sequences:
            model = self.accelerator.unwrap_model(self.model)
            with disable_gradient_checkpointing(self.model, cfg.gradient_checkpointing_kwargs):
                scores = answer_logprob_means(
                    model, sequences, answer_lengths, tokenizer.pad_token_id,
                    cfg.process_reward_batch_size or cfg.per_device_train_batch_size,
                )
        values, offset = [], 0
        for bounds in boundaries:
            n = len(bounds) + 1 if bounds else 0
            values.append(scores[offset : offset + n].tolist())
            offset += n
        width = output["completion_ids"].shape[1]
        rewards, reward_mask = process_rewards_from_values(values, boundaries, width)
        return rewards, reward_mask, values

    def _log_process_diagnostics(self, outcome, advantages, mask, rewards, reward_mask, values) -> None:
        """process-rewards post, "Adding Process Rewards to Your Pipeline": advantage stats with and without
        process rewards, and whether advantages vary within a sequence."""
        valid = mask.bool()
        device = mask.device

        def stats(x: torch.Tensor) -> torch.Tensor:
            x = x.float().to(device)
            return torch.stack([torch.tensor(float(x.numel()), device=device), x.sum(), x.pow(2).sum()])

        spread = torch.where(valid, advantages, -torch.inf).amax(1) - torch.where(valid, advantages, torch.inf).amin(1)
        has_tokens = valid.any(1)
        starts = torch.tensor([v[0] for v in values if v])
        ends = torch.tensor([v[-1] for v in values if v])
        rows = torch.tensor([float(has_tokens.sum()), float(((spread > 1e-6) & has_tokens).sum()), reward_mask.sum()])
        totals = {
            "adv_outcome": stats(outcome[valid]),
            "adv_with_process": stats(advantages[valid]),
            "utility": stats(rewards[reward_mask.bool()]),
            "value_start": stats(starts),
            "value_end": stats(ends),
            "rows": rows.to(device),
        }
        totals = {k: self.accelerator.reduce(v, reduction="sum").tolist() for k, v in totals.items()}
        for name in ("adv_outcome", "adv_with_process", "utility", "value_start", "value_end"):
            n, s, s2 = totals[name]
            mean = s / max(n, 1.0)
            self.log_metric(f"process/{name}_mean", mean)
            if name.startswith("adv") or name == "utility":
                self.log_metric(f"process/{name}_std", max(s2 / max(n, 1.0) - mean * mean, 0.0) ** 0.5)
        n_rows, n_varying, n_rewards = totals["rows"]
        self.log_metric("process/frac_rows_varying", n_varying / max(n_rows, 1.0))
        self.log_metric("process/rewards_per_row", n_rewards / max(n_rows, 1.0))
