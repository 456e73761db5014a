"""The baselines users compare against, on GRPOTrainer's machinery: GRPO (TRL's own
advantages) and RLOO, each also with training-free process rewards (seed 002)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from poise_trl import estimators
from poise_trl.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.trainers.base import AdvantageTrainer, CountingGRPOTrainer


@dataclass
class RLOOConfig(GRPOConfig):
    """GRPO settings; the advantage is r_i minus the mean reward of the other rollouts of
    the prompt, with no std scaling (Kool et al. 2019; TRL's RLOO default)."""


RLOO_DEFAULTS = {"scale_rewards": "none"}


class RLOOTrainer(AdvantageTrainer):
    """Leave-one-out baseline on GRPOTrainer (not `trl.RLOOTrainer`, so every algorithm
    here shares one generation, loss and logging path)."""

    def compute_advantages(self, rewards, output):
        return self.local_rows(estimators.rloo_advantages(rewards, self.num_generations))


@dataclass
class GRPOProcessConfig(ProcessRewardArguments, GRPOConfig):
    """GRPOConfig plus the process-reward settings."""


class GRPOProcessTrainer(ProcessRewardMixin, CountingGRPOTrainer):
    """TRL's GRPO (its own group-normalized outcome advantages) plus process rewards."""


@dataclass
class RLOOProcessConfig(ProcessRewardArguments, RLOOConfig):
    """RLOOConfig plus the process-reward settings."""


class RLOOProcessTrainer(ProcessRewardMixin, RLOOTrainer):
    """Leave-one-out outcome advantages plus process rewards."""
