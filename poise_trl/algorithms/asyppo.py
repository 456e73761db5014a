"""AsyPPO (arXiv 2510.01656) and, with one critic, PPO and VAPO (arXiv 2504.05118) on GRPOTrainer.

Inside TRL's `_generate_and_score_completions` the critics score, are fitted on disjoint shares of each
prompt's responses and give V-bar for a token-level GAE, then AsyPPO's disagreement masks apply;
`_compute_loss` adds the filtered entropy bonus and VAPO's positive-example NLL. `algo: ppo` and
`algo: vapo` are this trainer with other defaults. Details: docs/algorithms.md ("AsyPPO, PPO and VAPO").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from trl import GRPOConfig

from poise_trl.algorithms.base import CompareTable, register_algorithm, setting
from poise_trl.algorithms.critic_report import CriticReportCallback
from poise_trl.algorithms.critics import STATE_FILE, CriticEnsemble
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.core.distributed import gather_padded
from poise_trl.core.loading import resolve_model_path
from poise_trl.seam.grpo import GRPOSeam

CRITICS_DIR = "critics"
CRITIC_VALUES = ("before_update", "after_update", "cross_fit")


@dataclass
class AsyPPOConfig(ProcessRewardArguments, GRPOConfig):
    """GRPOConfig plus the critics, GAE, AsyPPO's masks and VAPO's options; defaults are the AsyPPO paper's.

    `entropy_coef` (TRL's field) is the beta of AsyPPO's filtered entropy term (`filtered_entropy_bonus`).
    """

    critic_model: str | None = setting(None, "Critic backbone: a causal LM (a scalar head is added) or a saved "
                                             "critic (*ForTokenClassification, e.g. data/tiny-critic or "
                                             "checkpoint-N/critics/critic_0). None: the actor's own model, i.e. a "
                                             "same-size critic (PPO, VAPO).")
    num_critics: int = setting(2, "M mini-critics (AsyPPO: 2 is the sweet spot).")
    critic_aggregation: str = setting("mean", "'mean' (AsyPPO's choice) or 'min' of the critics' values.")
    critic_values: str = setting("before_update", "Which values GAE uses: 'before_update' (the critics before "
                                                  "fitting this round, as PPO computes values at rollout time), "
                                                  "'after_update' (AsyPPO's order: fit, then V-bar) or 'cross_fit' "
                                                  "(after the fit, each response's V from the critics that did not "
                                                  "train on it; needs num_critics >= 2).")
    critic_learning_rate: float = setting(2e-6, "Critics' AdamW lr (VAPO: 2e-6).")
    critic_weight_decay: float = setting(0.0, "Critics' AdamW weight decay.")
    critic_max_grad_norm: float = setting(1.0, "Per-critic gradient clipping norm.")
    critic_epochs: int = setting(1, "Passes over the round's data per critic update.")
    critic_mini_batch_size: int | None = setting(None, "Rows per critic optimizer step, per process (None: "
                                                       "per_device_train_batch_size).")
    critic_micro_batch_size: int | None = setting(None, "Rows per critic forward pass (memory); None: "
                                                        "critic_mini_batch_size.")
    critic_dtype: str = setting("float32", "Critic weights and optimizer state: 'float32' (with bf16 autocast when "
                                           "bf16=True) or 'bfloat16' (pure bf16, to save memory with same-size "
                                           "critics).")
    gamma: float = setting(1.0, "Discount (VAPO paper: 1.0).")
    lambda_policy: float = setting(0.95, "GAE lambda of the policy's advantages (ignored when length_adaptive_alpha "
                                         "is set).")
    lambda_critic: float = setting(1.0, "GAE lambda of the critics' targets (VAPO's decoupled GAE: 1.0).")
    length_adaptive_alpha: float | None = setting(None, "VAPO length-adaptive GAE: lambda_policy = 1 - 1/(alpha * "
                                                        "length) per response (VAPO paper: 0.05). None: the constant "
                                                        "lambda_policy.")
    whiten_advantages: bool = setting(True, "Whiten the GAE advantages over the valid tokens of the global batch.")
    adv_mask_fraction: float = setting(0.2, "k: zero the advantages of the tokens whose critic std is in the lowest "
                                            "k of the batch (AsyPPO paper: 0.2). Needs num_critics >= 2.")
    entropy_filter_fraction: float = setting(0.2, "h: leave the tokens whose critic std is in the top h of the batch "
                                                  "out of the entropy bonus (AsyPPO paper: 0.2). Needs num_critics "
                                                  ">= 2.")
    value_warmup_steps: int = setting(0, "VAPO value pretraining: optimizer steps at the start in which only the "
                                         "critics learn (the actor takes no step; these steps count toward max_steps "
                                         "and the lr schedule).")
    positive_lm_coef: float = setting(0.0, "mu of VAPO's positive-example LM loss: L = L_PPO + mu * NLL of the "
                                           "correct responses (VAPO paper: 0.1).")
    positive_reward_threshold: float = setting(1.0, "A response counts as correct (positive example) when its reward "
                                                    ">= this.")

    # TRL's fields, at AsyPPO's values: its J_PPO, a per-response mean (1/|o| sum_t), clip 0.2,
    # no KL, and its entropy bonus; scale_rewards is unused (the advantages come from GAE).
    loss_type: str = setting("grpo", "Per-response mean loss (AsyPPO's J_PPO).")
    epsilon: float = setting(0.2, "Clip range.")
    beta: float = setting(0.0, "KL coefficient: no KL term.")
    scale_rewards: str = setting("none", "Unused: the advantages come from GAE.")
    entropy_coef: float = setting(1e-3, "beta of AsyPPO's filtered entropy bonus.")

    def __post_init__(self):
        super().__post_init__()
        if self.num_critics < 1:
            raise ValueError(f"num_critics must be >= 1, got {self.num_critics}")
        if self.num_generations % self.num_critics:
            raise ValueError(
                f"num_generations={self.num_generations} must be a multiple of num_critics={self.num_critics}: "
                "each prompt's responses are split evenly among the critics (AsyPPO paper)"
            )
        if self.critic_aggregation not in ("mean", "min"):
            raise ValueError(f"critic_aggregation must be 'mean' or 'min', got {self.critic_aggregation!r}")
        if self.critic_values not in CRITIC_VALUES:
            raise ValueError(f"critic_values must be one of {CRITIC_VALUES}, got {self.critic_values!r}")
        if self.critic_values == "cross_fit" and self.num_critics < 2:
            raise ValueError("critic_values='cross_fit' takes each response's value from the OTHER critics: it needs "
                             "num_critics >= 2; use 'before_update' or 'after_update' with one critic")
        if self.critic_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"critic_dtype must be 'float32' or 'bfloat16', got {self.critic_dtype!r}")
        for name in ("adv_mask_fraction", "entropy_filter_fraction", "lambda_policy", "lambda_critic", "gamma"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.num_critics == 1 and (self.adv_mask_fraction > 0 or self.entropy_filter_fraction > 0):
            raise ValueError(
                "adv_mask_fraction and entropy_filter_fraction rank tokens by the critics' disagreement, which "
                "needs num_critics >= 2; set both to 0 with one critic (PPO, VAPO)"
            )
        if self.length_adaptive_alpha is not None and self.length_adaptive_alpha <= 0:
            raise ValueError(f"length_adaptive_alpha must be > 0, got {self.length_adaptive_alpha}")
        if self.use_adaptive_entropy:
            raise ValueError("use_adaptive_entropy is not supported: the entropy bonus here is AsyPPO's filtered one")


@dataclass
class PPOConfig(AsyPPOConfig):
    """Plain PPO as VAPO's baseline describes it (docs/algorithms.md), each prompt sampled twice for TRL."""

    num_critics: int = setting(1, "One critic.")
    adv_mask_fraction: float = setting(0.0, "No disagreement mask (one critic).")
    entropy_filter_fraction: float = setting(0.0, "No entropy filter (one critic).")
    entropy_coef: float = setting(0.0, "No entropy bonus.")
    lambda_policy: float = setting(0.95, "GAE lambda of the policy's advantages.")
    lambda_critic: float = setting(0.95, "GAE lambda of the critic's targets.")
    num_generations: int | None = setting(2, "Rollouts per prompt.")


@dataclass
class VAPOConfig(PPOConfig):
    """VAPO (arXiv 2504.05118, training details): PPO plus VAPO's changes (docs/algorithms.md)."""

    lambda_critic: float = setting(1.0, "Decoupled GAE: lambda 1 for the critic.")
    length_adaptive_alpha: float | None = setting(0.05, "Length-adaptive GAE alpha.")
    epsilon_high: float | None = setting(0.28, "Upper clip range (clip-higher).")
    loss_type: str = setting("dapo", "Token-level loss.")
    positive_lm_coef: float = setting(0.1, "mu of the positive-example LM loss.")
    value_warmup_steps: int = setting(50, "Critic-only steps at the start.")
    num_generations: int | None = setting(16, "Rollouts per prompt (group sampling).")


class AsyPPOTrainer(ProcessRewardMixin, GRPOSeam):
    """GRPOTrainer whose per-token advantages come from GAE on an ensemble of critics."""

    off_policy_refusal = ("its critics would score rollouts of an older policy while training on the current one "
                          "(stale value targets, no correction), and its loss adds terms the asynchronous "
                          "trainer's fixed loss has no place for")

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        cfg = self.args
        self.check_groups_stay_on_one_process(
            "a prompt's responses would straddle two processes and could not be split among the critics"
        )
        # TRL's entropy bonus averages over every token; AsyPPO's skips the high-disagreement
        # ones (AsyPPO paper, I^H), so `_compute_loss` below adds it instead, with TRL's scaling.
        self.disable_trl_entropy_bonus()
        self.critics = CriticEnsemble(
            self._critic_path(model),
            cfg.num_critics,
            learning_rate=cfg.critic_learning_rate,
            weight_decay=cfg.critic_weight_decay,
            max_grad_norm=cfg.critic_max_grad_norm,
            epochs=cfg.critic_epochs,
            mini_batch_size=cfg.critic_mini_batch_size or cfg.per_device_train_batch_size,
            micro_batch_size=cfg.critic_micro_batch_size,
            dtype=getattr(torch, cfg.critic_dtype),
            autocast_dtype=torch.bfloat16 if cfg.bf16 and cfg.critic_dtype == "float32" else None,
            gradient_checkpointing=cfg.gradient_checkpointing,
            device=self.accelerator.device,
            seed=cfg.seed,
        )
        embeddings = self.critics.critics[0].get_input_embeddings().num_embeddings
        if embeddings < len(self.processing_class):
            raise ValueError(
                f"critic_model {self.critics.model_path!r} has {embeddings} token embeddings but the actor's "
                f"tokenizer has {len(self.processing_class)} tokens: the critic must share the actor's tokenizer"
            )
        self.critic_history: list[dict] = []  # one record per generation round

    def _critic_path(self, model) -> str:
        if self.args.critic_model is not None:
            return resolve_model_path(self.args.critic_model)
        return model if isinstance(model, str) else self.accelerator.unwrap_model(self.model).config._name_or_path

    def _actor_frozen(self) -> bool:
        return self.state.global_step < self.args.value_warmup_steps

    # -- advantages -------------------------------------------------------------------------

    def compute_advantages(self, rewards, output):
        cfg = self.args
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mask = output["completion_mask"]
        width = mask.size(1)
        local_rewards = self.local_rows(rewards).float()

        # Values before this round's critic update: out of sample for every row, and the base of
        # the critics' GAE targets when lambda_critic < 1.
        prior = self.critics.values(input_ids, attention_mask, width)
        prior_value = estimators.aggregate_critic_values(prior, cfg.critic_aggregation)
        # Outcome reward on the last valid token (no KL in the reward: beta, if any, is TRL's k3
        # loss). Rows with no valid token (mask_truncated_completions) carry nothing anywhere.
        token_rewards = torch.zeros_like(prior_value)
        rows = mask.sum(1) > 0
        token_rewards[rows] = estimators.kl_penalized_token_rewards(
            local_rewards[rows], token_rewards[rows], mask[rows], 0.0
        )
        if cfg.lambda_critic == 1.0:
            # GAE(lambda=1) = Monte-Carlo return minus V; returns_to_go gives that return exactly,
            # without the rounding of (G - V) + V (which turns an all-equal batch into noise).
            targets = estimators.returns_to_go(token_rewards, mask, cfg.gamma)
        else:
            _, targets = estimators.gae_advantages(token_rewards, prior_value, mask, cfg.gamma, cfg.lambda_critic)

        # Fit the critics, critic m on its share of every prompt's responses (AsyPPO paper, step 2).
        assignment = estimators.critic_group_assignment(mask.size(0), self.num_generations, len(self.critics))
        assignment = assignment.to(mask.device)
        fit = self.critics.update(input_ids, attention_mask, width, targets, mask, assignment)
        for name, number in fit.items():
            self.log_metric(f"critic/{name}", number)

        # V-bar for GAE (AsyPPO paper, step 3), from the critics as `critic_values` says.
        if cfg.critic_values == "before_update":
            values, value = prior, prior_value
        else:
            values = self.critics.values(input_ids, attention_mask, width)
            if cfg.critic_values == "after_update":
                value = estimators.aggregate_critic_values(values, cfg.critic_aggregation)
            else:
                value = estimators.cross_fit_values(values, assignment, cfg.critic_aggregation)
        if cfg.length_adaptive_alpha is not None:
            lam_policy = estimators.length_adaptive_lambda(mask.sum(1), cfg.length_adaptive_alpha).to(value.device)
        else:
            lam_policy = cfg.lambda_policy
        advantages, _ = estimators.gae_advantages(token_rewards, value, mask, cfg.gamma, lam_policy)
        # Population std: 0 (not nan) for a single critic, |V1 - V2| / 2 for two.
        critic_std = values.std(0, correction=0)

        # Over the global batch: whitening, Low_k / Top_h of sigma (AsyPPO paper, steps 4-5).
        g_mask, g_adv, g_std = (gather_padded(self.accelerator, t) for t in (mask, advantages, critic_std))
        raw_std = g_adv[g_mask.bool()].float().std().item() if int(g_mask.sum()) > 1 else 0.0
        if cfg.whiten_advantages:
            g_adv = estimators.masked_whiten(g_adv, g_mask)
        low = estimators.low_disagreement_mask(g_std, g_mask, cfg.adv_mask_fraction)
        high = estimators.high_disagreement_mask(g_std, g_mask, cfg.entropy_filter_fraction)
        g_adv = torch.where(low, torch.zeros_like(g_adv), g_adv)
        g_targets = gather_padded(self.accelerator, targets)
        record = self._log_critic_round(g_mask, g_std, low, high, gather_padded(self.accelerator, prior_value),
                                        gather_padded(self.accelerator, value), g_targets, g_adv, rewards.float(),
                                        raw_std)
        record["value_loss"] = fit["value_loss"]
        self.critic_history.append(record)

        # Extra per-row keys travel through TRL's shuffle and split with the rest of the batch.
        output["entropy_filter"] = self.local_rows(high)[:, :width].float()
        positive = (local_rewards >= cfg.positive_reward_threshold).float()
        output["positive"] = positive
        output["num_positive_tokens"] = self.accelerator.gather((mask * positive.unsqueeze(1)).sum()).sum()
        self.log_metric("vapo/positive_fraction", self.accelerator.gather(positive).mean().item())
        if cfg.length_adaptive_alpha is not None:
            self.log_metric("vapo/lambda_policy_mean", self.accelerator.gather(lam_policy).mean().item())
        self.log_metric("vapo/actor_frozen", float(self._actor_frozen()))
        return self.local_rows(g_adv)[:, :width]

    def _log_critic_round(self, mask, critic_std, low, high, prior_value, value, targets, advantages, rewards,
                          raw_std) -> dict:
        """Log this round's critic diagnostics (global batch) and return them as a history record.

        `explained_variance` is that of the values GAE used; `..._prior` of the values before this round's
        update (out of sample); `..._first_token` on V(s_0); `mc_sign_agreement`: see `sign_agreement`.
        """
        valid = mask.bool()
        n_valid = valid.sum().clamp(min=1)
        first = valid[:, 0]
        mc_advantage = estimators.group_mean_advantages(rewards.to(mask.device), self.num_generations)
        record = {
            "step": self.state.global_step,
            "explained_variance": estimators.explained_variance(value, targets, mask),
            "explained_variance_prior": estimators.explained_variance(prior_value, targets, mask),
            "explained_variance_first_token": estimators.explained_variance(value[:, :1], targets[:, :1], mask[:, :1]),
            "explained_variance_prior_first_token": estimators.explained_variance(
                prior_value[:, :1], targets[:, :1], mask[:, :1]),
            "mc_sign_agreement": estimators.sign_agreement(advantages, mc_advantage[:, None].expand_as(mask), mask),
            "value_mean": value[valid].mean().item(),
            "return_mean": targets[valid].mean().item(),
            "advantage_raw_std": raw_std,
            "adv_masked_fraction": (low.sum() / n_valid).item(),
            "entropy_filtered_fraction": (high.sum() / n_valid).item(),
            "predicted_first_token": [round(v, 4) for v in value[first, 0].tolist()],
            "prior_first_token": [round(v, 4) for v in prior_value[first, 0].tolist()],
            "realised_return": [round(v, 4) for v in targets[first, 0].tolist()],
        }
        for key in ("explained_variance", "explained_variance_prior", "explained_variance_first_token",
                    "explained_variance_prior_first_token", "mc_sign_agreement", "value_mean", "return_mean"):
            self.log_metric(f"critic/{key}", record[key])
        self.log_metric("advantages/raw_std", raw_std)
        if len(self.critics) > 1:
            quantiles = torch.quantile(critic_std[valid].float(), torch.tensor([0.1, 0.5, 0.9], device=mask.device))
            for name, q in zip(("p10", "p50", "p90"), quantiles.tolist(), strict=True):
                self.log_metric(f"critic/std_{name}", q)
            self.log_metric("asyppo/adv_masked_fraction", record["adv_masked_fraction"])
            self.log_metric("asyppo/entropy_filtered_fraction", record["entropy_filtered_fraction"])
        return record

    # -- loss -------------------------------------------------------------------------------

    def policy_loss(self, model, inputs):
        if not self.model.training:
            return super().policy_loss(model, inputs)
        if self._actor_frozen():
            # VAPO's value pretraining: a zero loss with no graph leaves every .grad None, so AdamW skips
            # even its weight decay.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        loss, (per_token_logps, entropies, _) = self.trl_loss(model, inputs)
        cfg = self.args
        mask = inputs["completion_mask"].float()
        kept = mask * (1.0 - inputs["entropy_filter"])
        if len(self.critics) > 1:
            # Entropy with and without the filter: TRL logs `entropy` over every token.
            for name, weights in (("entropy_kept", kept), ("entropy_dropped", mask - kept)):
                totals = self.accelerator.reduce(torch.stack([(entropies * weights).sum(), weights.sum()]).detach())
                if totals[1] > 0:
                    self.log_metric(f"asyppo/{name}", (totals[0] / totals[1]).item())
        if self.entropy_coef:
            # AsyPPO paper, beta * (1/|o|) sum_t I^H_t H_t inside J_PPO's per-response mean, then the
            # mean over responses; scaled for gradient accumulation as TRL scales its own terms.
            bonus = estimators.filtered_entropy_bonus(entropies, 1.0 - inputs["entropy_filter"], mask).mean()
            loss = loss - self.entropy_coef * bonus / self.current_gradient_accumulation_steps
        if cfg.positive_lm_coef:
            # VAPO's L = L_PPO + mu * L_NLL over the correct responses, normalised like TRL's "dapo" loss so
            # the micro-batches of a round add up to that mean.
            positive_tokens = mask * inputs["positive"].unsqueeze(1)
            normalizer = inputs["num_positive_tokens"].clamp(min=1.0) / self.accelerator.num_processes
            normalizer = normalizer * self.current_gradient_accumulation_steps / cfg.steps_per_generation
            nll = -(per_token_logps * positive_tokens).sum() / normalizer
            loss = loss + cfg.positive_lm_coef * nll
            self.log_metric("vapo/positive_nll", self.accelerator.gather(nll.detach()).mean().item())
        return loss

    # -- checkpoints ------------------------------------------------------------------------

    def save_side_state(self, checkpoint: Path) -> None:
        self.critics.save(checkpoint / CRITICS_DIR)

    def load_side_state(self, checkpoint: Path) -> None:
        critic_dir = checkpoint / CRITICS_DIR
        if not (critic_dir / STATE_FILE).exists():
            raise FileNotFoundError(
                f"checkpoint {checkpoint} has no critic state ({CRITICS_DIR}/{STATE_FILE}): it was not written by "
                "AsyPPOTrainer (asyppo / ppo / vapo), or was copied without it. Resuming would restart the critics "
                "from scratch under a trained actor; start a fresh run instead, or resume from a checkpoint of this "
                "trainer."
            )
        self.critics.load(critic_dir)


def critic_memory(value, plan) -> list[tuple[str, int, str]]:
    """`poise plan`'s items for the critics, replicated on every GPU (poise_trl.algorithms.critics): weights, grads and
    AdamW, and one critic forward's activations at `critic_micro_batch_size` rows."""
    count = int(value("num_critics") or 0)
    if not count:
        return []
    rows = int(value("critic_micro_batch_size") or value("critic_mini_batch_size")
               or value("per_device_train_batch_size"))
    shape = plan.model_shape(value("critic_model") or plan.inputs.model)
    size = plan.dtype_bytes(str(value("critic_dtype") or "float32"))
    # a token-classification critic: the backbone plus a (hidden, 1) head instead of the LM head
    backbone = shape.parameters - (0 if shape.tied_embeddings else shape.lm_head_parameters)
    compute = 2 if (plan.autocast or size == 2) else 4
    return [("critics: weights, grads, AdamW", count * backbone * 4 * size,
             f"{count} x {backbone / 1e9:.2f}B x 4 x {size} B, replicated"),
            ("critic activations", plan.activation_bytes(shape, rows * plan.sequence, compute, size),
             f"{rows} rows per critic forward")]


CRITIC_DECLARES = dict(
    callbacks=(CriticReportCallback,), run_files=("critic_report.json", "critic_values.png"),
    memory_items=critic_memory,
    # after the critics have had time to learn (issue 17's bar: explained variance >= 0.3)
    compare_tables=(CompareTable("critics_second_half", "critics, second half of training (mean ± std over seeds)",
                                 {"critic/explained_variance": ("explained variance", "second_half"),
                                  "critic/explained_variance_first_token": ("EV first token", "second_half"),
                                  "critic/mc_sign_agreement": ("sign agreement with MC advantage", "second_half")},
                                 spread=True, seeds_below_start=True),),
)
register_algorithm("asyppo", AsyPPOConfig, AsyPPOTrainer, "AsyPPO",
                   "2 small critics on disjoint halves, GAE, std-based masks",
                   card="AsyPPO: small critics on disjoint halves of each group, GAE", **CRITIC_DECLARES)
register_algorithm("ppo", PPOConfig, AsyPPOTrainer, "PPO", "PPO: 1 same-size critic, GAE lambda 0.95",
                   card="PPO with one critic, GAE", **CRITIC_DECLARES)
register_algorithm("vapo", VAPOConfig, AsyPPOTrainer, "VAPO",
                   "VAPO: PPO + value warm-up, decoupled/adaptive GAE, positive LM loss",
                   card="VAPO: value-based PPO", **CRITIC_DECLARES)
