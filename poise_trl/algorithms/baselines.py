"""The baselines users compare against, on GRPOTrainer's machinery: GRPO and RLOO, one trainer whose outcome
advantages a recipe names (`advantage:`, `core/estimators.OUTCOME_ADVANTAGES`). Process rewards are a switch
of every GRPO-based algorithm (`process_rewards: true`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from poise_trl.algorithms.base import register_algorithm, setting
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.seam.grpo import GRPOSeam


@dataclass
class GRPOArmConfig(ProcessRewardArguments, GRPOConfig):
    """TRL's GRPOConfig plus the outcome advantages by name."""

    advantage: str | None = setting(None, "Outcome advantages by name, one of "
                                          f"{', '.join(estimators.OUTCOME_ADVANTAGES)} (core/estimators.py); null: "
                                          "TRL's own (group mean, scaled as scale_rewards says).")

    def __post_init__(self):
        if self.advantage is not None and self.advantage not in estimators.OUTCOME_ADVANTAGES:
            raise ValueError(f"advantage must be one of {', '.join(estimators.OUTCOME_ADVANTAGES)} or null, got "
                             f"{self.advantage!r}")
        super().__post_init__()


@dataclass
class RLOOConfig(GRPOArmConfig):
    """GRPO settings; the advantage is r_i minus the mean reward of the other rollouts of
    the prompt, with no std scaling (Kool et al. 2019; TRL's RLOO default)."""

    advantage: str | None = setting("rloo", "Leave-one-out baseline.")
    scale_rewards: str = setting("none", "No std division of the advantages.")


class OutcomeAdvantages:
    """The recipe's outcome advantages, on either seam (`GRPOSeam`, `AsyncGRPOSeam`)."""

    @staticmethod
    def off_policy_conflict(config) -> str | None:
        if config.advantage is None and config.scale_rewards != "group":
            return (f"advantage: null keeps its worker's group-std-scaled advantages, not scale_rewards "
                    f"{config.scale_rewards!r}: name one, e.g. advantage: group_mean")
        return None

    def compute_advantages(self, rewards, output):
        if self.args.advantage is None:
            return None
        return self.local_rows(estimators.OUTCOME_ADVANTAGES[self.args.advantage](rewards, self.num_generations))


class OutcomeTrainer(OutcomeAdvantages, ProcessRewardMixin, GRPOSeam):
    """GRPOTrainer with the recipe's outcome advantages (not `trl.RLOOTrainer`, so every algorithm here shares
    one generation, loss and logging path)."""

    async_events = OutcomeAdvantages


register_algorithm("grpo", GRPOArmConfig, OutcomeTrainer, "GRPO",
                   "TRL's GRPO: group-mean baseline scaled by the group std",
                   card="GRPO: group-mean baseline scaled by the group standard deviation")
register_algorithm("rloo", RLOOConfig, OutcomeTrainer, "RLOO", "leave-one-out baseline, no std scaling",
                   card="RLOO: leave-one-out baseline")
