"""Algorithm registry: recipe `algo` name -> (config class, trainer class, config defaults).

Defaults here are the algorithm's defining settings (what makes DAPO DAPO); a recipe may
still override any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from poise_trl.trainers.a2po import A2PO_DEFAULTS, A2POArmConfig, CountingA2POTrainer
from poise_trl.trainers.asyppo import (
    ASYPPO_DEFAULTS,
    PPO_DEFAULTS,
    VAPO_DEFAULTS,
    AsyPPOConfig,
    AsyPPOTrainer,
)
from poise_trl.trainers.base import CountingGRPOTrainer
from poise_trl.trainers.baselines import (
    RLOO_DEFAULTS,
    GRPOProcessConfig,
    GRPOProcessTrainer,
    RLOOConfig,
    RLOOProcessConfig,
    RLOOProcessTrainer,
    RLOOTrainer,
)
from poise_trl.trainers.dapo import DAPO_DEFAULTS, DAPOConfig, DAPOTrainer
from poise_trl.trainers.poise import (
    POISE_DEFAULTS,
    POISEConfig,
    POISEProcessConfig,
    POISEProcessTrainer,
    POISETrainer,
)
from poise_trl.trainers.reinforce_pp import (
    REINFORCE_PP_BASELINE_DEFAULTS,
    REINFORCE_PP_DEFAULTS,
    REINFORCEPPConfig,
    REINFORCEPPTrainer,
)


@dataclass(frozen=True)
class Algorithm:
    config_class: type
    trainer_class: type
    defaults: dict = field(default_factory=dict)
    description: str = ""


PROCESS_REWARDS = {"process_rewards": True}

ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(GRPOConfig, CountingGRPOTrainer, {}, "TRL's GRPO: group-mean baseline scaled by the group std"),
    "rloo": Algorithm(RLOOConfig, RLOOTrainer, RLOO_DEFAULTS, "leave-one-out baseline, no std scaling"),
    "poise": Algorithm(POISEConfig, POISETrainer, POISE_DEFAULTS, "2 rollouts, cross-rollout baseline from a hidden-state probe"),
    "asyppo": Algorithm(AsyPPOConfig, AsyPPOTrainer, ASYPPO_DEFAULTS, "2 small critics on disjoint halves, GAE, std-based masks"),
    "ppo": Algorithm(AsyPPOConfig, AsyPPOTrainer, PPO_DEFAULTS, "PPO: 1 same-size critic, GAE lambda 0.95"),
    "vapo": Algorithm(AsyPPOConfig, AsyPPOTrainer, VAPO_DEFAULTS, "VAPO: PPO + value warm-up, decoupled/adaptive GAE, positive LM loss"),
    "dapo": Algorithm(DAPOConfig, DAPOTrainer, DAPO_DEFAULTS, "DAPO: clip-higher, token-level loss, overlong shaping, dynamic sampling"),
    "reinforce_pp": Algorithm(REINFORCEPPConfig, REINFORCEPPTrainer, REINFORCE_PP_DEFAULTS, "REINFORCE++: k1 KL in the reward, global normalization (k >= 1)"),
    "reinforce_pp_baseline": Algorithm(REINFORCEPPConfig, REINFORCEPPTrainer, REINFORCE_PP_BASELINE_DEFAULTS, "REINFORCE++ w/ Baseline: group mean, global std, k2 KL loss"),
    "grpo_process": Algorithm(GRPOProcessConfig, GRPOProcessTrainer, PROCESS_REWARDS, "GRPO + training-free process rewards (seed 002)"),
    "rloo_process": Algorithm(RLOOProcessConfig, RLOOProcessTrainer, {**RLOO_DEFAULTS, **PROCESS_REWARDS}, "RLOO + training-free process rewards (seed 002)"),
    "poise_process": Algorithm(POISEProcessConfig, POISEProcessTrainer, {**POISE_DEFAULTS, **PROCESS_REWARDS}, "POISE + training-free process rewards (seed 002)"),
    "a2po": Algorithm(A2POArmConfig, CountingA2POTrainer, A2PO_DEFAULTS, "A*-PO (TRL experimental): offline V* from reference samples, 1 rollout per prompt"),
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        import difflib

        close = difflib.get_close_matches(name, ALGORITHMS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algo {name!r}{hint} (known: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "Algorithm", "POISEConfig", "POISETrainer", "RLOOConfig", "RLOOTrainer", "get_algorithm"]
