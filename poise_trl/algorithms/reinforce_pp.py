"""REINFORCE++ and REINFORCE++ w/ Baseline (arXiv 2501.03262) on GRPOTrainer.

`reinforce_pp` (k >= 1): k1 KL in the per-token reward, returns-to-go, global normalization (Eqs. 4-5).
`reinforce_pp_baseline` (k > 1): group mean, global std (Eqs. 6-7), k2 KL loss (Eq. 8) added by
`_compute_loss` to TRL's loss run with beta 0. Details: docs/algorithms.md ("REINFORCE++"), docs/trl.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOConfig
from trl.models.utils import disable_gradient_checkpointing

from poise_trl.algorithms.base import AdvantageTrainer, register_algorithm, setting
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.core.distributed import gather_padded

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class REINFORCEPPConfig(ProcessRewardArguments, GRPOConfig):
    """GRPOConfig plus REINFORCE++'s advantage and KL choices. `beta` is the KL coefficient
    wherever the KL goes (reward for k1, loss for k2/k3)."""

    kl_estimator: str = setting("k1", "'k1': -beta * k1 per token inside the reward (Eq. (4)); 'k2': beta * k2 as a "
                                      "loss term (Eq. (8), reverse-KL gradient); 'k3': TRL's own k3 loss term. Off "
                                      "when beta = 0.")
    group_baseline: bool = setting(False, "Subtract the group-mean reward before global normalization (REINFORCE++ "
                                          "w/ Baseline, Eqs. (6)-(7)); needs num_generations >= 2.")
    # TRL's fields, at REINFORCE++'s values: a small KL, per-response mean loss.
    beta: float = setting(1e-3, "KL coefficient (k1 in the reward by default).")
    loss_type: str = setting("grpo", "Per-response mean loss.")

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.group_baseline and self.num_generations < 2:
            raise ValueError("group_baseline (REINFORCE++ w/ Baseline) needs num_generations >= 2 to form a group "
                             "mean")
        if self.kl_estimator == "k1" and self.beta != 0 and self.mask_truncated_completions:
            raise ValueError("kl_estimator='k1' puts the outcome on each completion's last token; "
                             "mask_truncated_completions would leave truncated rows without one")
        if self.num_generations != 1:
            super().__post_init__()
            return
        if self.per_device_train_batch_size < 2:
            raise ValueError("num_generations=1 needs per_device_train_batch_size >= 2 (global normalization)")
        # GRPOConfig's only objection to k = 1 is its "num_generations < 2" check; the generation
        # batch is always a multiple of per_device_train_batch_size, so that placeholder divides it.
        if self.num_generations_eval is None:
            self.num_generations_eval = 1
        self.num_generations = self.per_device_train_batch_size
        super().__post_init__()
        self.num_generations = 1


@dataclass
class REINFORCEPPBaselineConfig(REINFORCEPPConfig):
    """REINFORCE++ w/ Baseline (Eqs. (6)-(8)): group-mean baseline, then global normalization, with the k2
    KL as a loss term."""

    group_baseline: bool = setting(True, "Subtract the group-mean reward first.")
    kl_estimator: str = setting("k2", "beta * k2 as a loss term (Eq. (8)).")


class REINFORCEPPTrainer(ProcessRewardMixin, AdvantageTrainer):
    """REINFORCE++ / REINFORCE++ w/ Baseline; process rewards via `process_rewards: true`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._capture_logps = False
        self._captured_logps = None

    # -- advantages -------------------------------------------------------------------------

    def compute_advantages(self, rewards, output):
        cfg = self.args
        if cfg.kl_estimator != "k1" or self.beta == 0.0:  # global normalization over the batch's samples
            if cfg.group_baseline:  # Eqs. (6)-(7)
                advantages = estimators.reinforce_pp_baseline_advantages(rewards, self.num_generations)
                return self.local_rows(advantages)
            return self.local_rows(estimators.reinforce_pp_global_advantages(rewards))  # Eq. (5) with A = r
        outcome = rewards
        if cfg.group_baseline:  # Eq. (6)
            outcome = estimators.group_mean_advantages(rewards, self.num_generations)
        # Eq. (4): r - beta * sum_{i >= t} k1(i), with k1 of pi_old against pi_ref; then Eq. (5) over tokens.
        mask = output["completion_mask"]
        kl = estimators.kl_k1(self._old_logps(output), output["ref_per_token_logps"])
        token_rewards = estimators.kl_penalized_token_rewards(self.local_rows(outcome), kl, mask, self.beta)
        returns = estimators.returns_to_go(token_rewards, mask)
        advantages = estimators.reinforce_pp_global_advantages(
            gather_padded(self.accelerator, returns), gather_padded(self.accelerator, mask)
        )
        self._metrics["train"]["kl"].append(self._global_mean(kl, mask))
        return self.local_rows(advantages)[:, : mask.shape[1]]

    def _old_logps(self, output: dict) -> torch.Tensor:
        """log pi_old of the sampled tokens: TRL's when it computed them, else one chunked no-grad pass."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        valid = mask.bool()
        totals = torch.stack([torch.where(valid, values, 0.0).sum(), valid.sum().to(values.dtype)])
        total, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        return total / max(count, 1.0)

    # -- KL loss term -----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, **kwargs):
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
        )
        if self._capture_logps:  # armed in `_compute_loss`, whose first forward is the policy's
            self._captured_logps, self._capture_logps = out[0], False
        return out

    def _compute_loss(self, model, inputs):
        if self.args.kl_estimator == "k3" or self.beta == 0.0:
            return super()._compute_loss(model, inputs)
        beta, self.beta = self.beta, 0.0  # TRL adds no k3 term now
        self._capture_logps = self.args.kl_estimator == "k2"
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta, self._capture_logps = beta, False
        if self.args.kl_estimator == "k1":
            return loss  # the KL is in the reward (Eq. (4)), not in the loss (REINFORCE++ paper, App. B.1)
        logps, self._captured_logps = self._captured_logps, None
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        k2 = estimators.kl_k2(logps, inputs["ref_per_token_logps"])  # Eq. (8)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["kl"].append(self._global_mean(k2.detach(), mask))
        return loss + beta * self.aggregate_like_trl(k2, mask, inputs)

    def aggregate_like_trl(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """TRL 1.16's reduction of `per_token_loss` for `self.loss_type` (grpo_trainer.py, `_compute_loss`),
        including its gradient-accumulation scaling, so an extra per-token term enters the loss
        exactly as TRL's own KL term would."""
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        mask = mask.to(per_token.dtype)
        if self.loss_type in ("grpo", "sapo"):
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return (per_token * mask).sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if self.loss_type in ("cispo", "dapo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return (per_token * mask).sum() / normalizer
        if self.loss_type == "luspo":
            return (per_token * mask).sum(-1).mean() / accumulation
        raise ValueError(f"Unknown loss type: {self.loss_type}")


register_algorithm("reinforce_pp", REINFORCEPPConfig, REINFORCEPPTrainer, "REINFORCE++",
                   "REINFORCE++: k1 KL in the reward, global normalization (k >= 1)",
                   card="REINFORCE++: global advantage normalization", min_generations=1)
register_algorithm("reinforce_pp_baseline", REINFORCEPPBaselineConfig, REINFORCEPPTrainer, "REINFORCE++ w/ Baseline",
                   "REINFORCE++ w/ Baseline: group mean, global std, k2 KL loss",
                   card="REINFORCE++ w/ Baseline: group mean, then global normalization")
