"""The baselines users compare against, on GRPOTrainer's machinery: GRPO (TRL's own
advantages) and RLOO, each also with training-free process rewards."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from poise_trl.algorithms.base import register_algorithm, setting
from poise_trl.algorithms.process_rewards import ProcessRewardMixin, ProcessRewardsOn
from poise_trl.core import estimators
from poise_trl.seam.grpo import GRPOSeam


@dataclass
class RLOOConfig(GRPOConfig):
    """GRPO settings; the advantage is r_i minus the mean reward of the other rollouts of
    the prompt, with no std scaling (Kool et al. 2019; TRL's RLOO default)."""

    scale_rewards: str = setting("none", "No std division of the advantages.")


class RLOOTrainer(GRPOSeam):
    """Leave-one-out baseline on GRPOTrainer (not `trl.RLOOTrainer`, so every algorithm
    here shares one generation, loss and logging path)."""

    def compute_advantages(self, rewards, output):
        return self.local_rows(estimators.rloo_advantages(rewards, self.num_generations))


@dataclass
class GRPOProcessConfig(ProcessRewardsOn, GRPOConfig):
    """GRPOConfig plus the process-reward settings, switched on."""


class GRPOProcessTrainer(ProcessRewardMixin, GRPOSeam):
    """TRL's GRPO (its own group-normalized outcome advantages) plus process rewards."""


@dataclass
class RLOOProcessConfig(ProcessRewardsOn, RLOOConfig):
    """RLOOConfig plus the process-reward settings, switched on."""


class RLOOProcessTrainer(ProcessRewardMixin, RLOOTrainer):
    """Leave-one-out outcome advantages plus process rewards."""


register_algorithm("grpo", GRPOConfig, GRPOSeam, "GRPO",
                   "TRL's GRPO: group-mean baseline scaled by the group std",
                   card="GRPO: group-mean baseline scaled by the group standard deviation")
register_algorithm("rloo", RLOOConfig, RLOOTrainer, "RLOO", "leave-one-out baseline, no std scaling",
                   card="RLOO: leave-one-out baseline")
register_algorithm("grpo_process", GRPOProcessConfig, GRPOProcessTrainer, "GRPO",
                   "GRPO + training-free process rewards")
register_algorithm("rloo_process", RLOOProcessConfig, RLOOProcessTrainer, "RLOO",
                   "RLOO + training-free process rewards")
