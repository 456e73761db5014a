"""REINFORCE++ and REINFORCE++ w/ Baseline (arXiv 2501.03262) on GRPOTrainer.

`reinforce_pp` (k >= 1): k1 KL in the per-token reward, returns-to-go, global normalization (Eqs. 4-5).
`reinforce_pp_baseline` (k > 1): group mean, global std (Eqs. 6-7), k2 KL loss (Eq. 8) added by
`_compute_loss` to TRL's loss run with beta 0. Details: docs/algorithms.md ("REINFORCE++"), docs/trl.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import GRPOConfig

from poise_trl.algorithms.base import register_algorithm, setting
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.core.distributed import gather_padded
from poise_trl.seam.grpo import GRPOSeam

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


class REINFORCEPPAdvantages:
    """REINFORCE++'s advantages with no KL in the reward (beta 0, or the KL in the loss): global normalization
    over the batch's samples, on either seam (`GRPOSeam`, `AsyncGRPOSeam`)."""

    def compute_advantages(self, rewards, output):
        if self.args.group_baseline:  # Eqs. (6)-(7)
            return self.local_rows(estimators.reinforce_pp_baseline_advantages(rewards, self.num_generations))
        return self.local_rows(estimators.reinforce_pp_global_advantages(rewards))  # Eq. (5) with A = r


class REINFORCEPPTrainer(REINFORCEPPAdvantages, ProcessRewardMixin, GRPOSeam):
    """REINFORCE++ / REINFORCE++ w/ Baseline; process rewards via `process_rewards: true`."""

    async_events = REINFORCEPPAdvantages

    # -- advantages -------------------------------------------------------------------------

    def compute_advantages(self, rewards, output):
        cfg = self.args
        if cfg.kl_estimator != "k1" or self.beta == 0.0:
            return super().compute_advantages(rewards, output)
        outcome = rewards
        if cfg.group_baseline:  # Eq. (6)
            outcome = estimators.group_mean_advantages(rewards, self.num_generations)
        # Eq. (4): r - beta * sum_{i >= t} k1(i), with k1 of pi_old against pi_ref; then Eq. (5) over tokens.
        mask = output["completion_mask"]
        kl = estimators.kl_k1(self.old_policy_logps(output), output["ref_per_token_logps"])
        token_rewards = estimators.kl_penalized_token_rewards(self.local_rows(outcome), kl, mask, self.beta)
        returns = estimators.returns_to_go(token_rewards, mask)
        advantages = estimators.reinforce_pp_global_advantages(
            gather_padded(self.accelerator, returns), gather_padded(self.accelerator, mask)
        )
        self.log_metric("kl", self._global_mean(kl, mask))
        return self.local_rows(advantages)[:, : mask.shape[1]]

    def _global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        valid = mask.bool()
        totals = torch.stack([torch.where(valid, values, 0.0).sum(), valid.sum().to(values.dtype)])
        total, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        return total / max(count, 1.0)

    # -- KL loss term -----------------------------------------------------------------------

    def policy_loss(self, model, inputs):
        if self.args.kl_estimator == "k3" or self.beta == 0.0:
            return super().policy_loss(model, inputs)
        loss, (logps, _, _) = self.trl_loss(model, inputs, beta=0.0)  # TRL adds no k3 term
        if self.args.kl_estimator == "k1":
            return loss  # the KL is in the reward (Eq. (4)), not in the loss (REINFORCE++ paper, App. B.1)
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        k2 = estimators.kl_k2(logps, inputs["ref_per_token_logps"])  # Eq. (8)
        self.log_metric("kl", self._global_mean(k2.detach(), mask), self.mode)
        return loss + self.beta * self.aggregate_like_trl(k2, mask, inputs)


register_algorithm("reinforce_pp", REINFORCEPPConfig, REINFORCEPPTrainer, "REINFORCE++",
                   "REINFORCE++: k1 KL in the reward, global normalization (k >= 1)",
                   card="REINFORCE++: global advantage normalization", min_generations=1)
register_algorithm("reinforce_pp_baseline", REINFORCEPPBaselineConfig, REINFORCEPPTrainer, "REINFORCE++ w/ Baseline",
                   "REINFORCE++ w/ Baseline: group mean, global std, k2 KL loss",
                   card="REINFORCE++ w/ Baseline: group mean, then global normalization")
