"""REINFORCE++ on a 2-layer random model: k = 1, the token-level k1 path, and the KL loss terms."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_saved_weights_moved, build_trainer
from test_train import tiny_recipe
from trl import GRPOTrainer

from poise_trl.algorithms.reinforce_pp import REINFORCEPPConfig
from poise_trl.core import estimators as est
from poise_trl.run.train import train_from_recipe

BASE = dict(output_dir="unused", use_cpu=True, report_to="none")


def test_config_lifts_the_two_rollout_rule_for_k1():
    cfg = REINFORCEPPConfig(num_generations=1, per_device_train_batch_size=3, **BASE)
    assert cfg.num_generations == 1 and cfg.generation_batch_size == 3 and cfg.num_generations_eval == 1
    with pytest.raises(ValueError, match="per_device_train_batch_size >= 2"):
        REINFORCEPPConfig(num_generations=1, per_device_train_batch_size=1, **BASE)
    with pytest.raises(ValueError, match="group mean"):
        REINFORCEPPConfig(num_generations=1, per_device_train_batch_size=4, group_baseline=True, **BASE)
    with pytest.raises(ValueError, match="kl_estimator"):
        REINFORCEPPConfig(num_generations=2, per_device_train_batch_size=4, kl_estimator="k4", **BASE)
    # the other GRPOConfig checks still run
    with pytest.raises(ValueError, match="divisible by num_generations"):
        REINFORCEPPConfig(num_generations=3, per_device_train_batch_size=4, **BASE)


def make_trainer(model_dir, out, algo="reinforce_pp", **overrides):
    recipe = {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 12, "max_steps": 1,
        "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0, "beta": 0.05, **overrides,
    }
    trainer = build_trainer(recipe, out)
    # Move the policy away from the reference so that every KL estimator is non-zero.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def generation_round(trainer):
    return trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))


def policy_logps(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, inputs["completion_ids"].size(1)
        )
    return logps


@pytest.mark.slow
def test_k1_in_reward_gives_globally_normalized_token_advantages(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "k1", num_generations=1)
    assert trainer.num_generations == 1
    output = generation_round(trainer)
    mask = output["completion_mask"]
    adv = output["advantages"]
    assert adv.shape == mask.shape
    # Eq. (4) -> (5) by hand from the pieces: k1 of pi_old (= the policy now) against pi_ref
    rewards = trainer.round.rewards_per_func.sum(dim=1)
    kl = policy_logps(trainer, output) - output["ref_per_token_logps"]
    returns = est.returns_to_go(est.kl_penalized_token_rewards(rewards, kl, mask, 0.05), mask)
    torch.testing.assert_close(adv, est.masked_whiten(returns, mask), atol=1e-5, rtol=0)
    valid = mask.bool()
    assert abs(adv[valid].mean().item()) < 1e-5 and abs(adv[valid].std().item() - 1.0) < 1e-4
    assert (adv[valid] != adv[valid][0]).any()


@pytest.mark.slow
def test_kl_loss_terms_enter_like_trls_own(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "kl", algo="reinforce_pp_baseline")
    inputs = generation_round(trainer)
    mask, ref = inputs["completion_mask"], inputs["ref_per_token_logps"]
    logps = policy_logps(trainer, inputs)
    assert (est.kl_k2(logps, ref)[mask.bool()] > 1e-6).all()
    beta = trainer.beta
    for loss_type in ("grpo", "dapo", "bnpo", "dr_grpo"):
        trainer.loss_type = loss_type

        def loss(compute=trainer._compute_loss):  # grad mode on: the k2 path captures TRL's grad-carrying logps
            return compute(trainer.model, inputs).detach()

        trainer.beta = 0.0
        plain = loss(lambda model, x: GRPOTrainer._compute_loss(trainer, model, x))
        trainer.beta = beta
        trl_k3 = loss(lambda model, x: GRPOTrainer._compute_loss(trainer, model, x))
        # the aggregation mirror reproduces TRL's own k3 term
        k3_term = beta * trainer.aggregate_like_trl(est.kl_k3(logps, ref), mask, inputs)
        torch.testing.assert_close(trl_k3 - plain, k3_term, atol=1e-6, rtol=1e-5)
        # Eq. (8): k2 in place of k3
        trainer.args.kl_estimator = "k2"
        k2_term = beta * trainer.aggregate_like_trl(est.kl_k2(logps, ref), mask, inputs)
        torch.testing.assert_close(loss(), plain + k2_term, atol=1e-6, rtol=1e-5)
        # k1 lives in the reward: no KL in the loss
        trainer.args.kl_estimator = "k1"
        torch.testing.assert_close(loss(), plain, atol=1e-7, rtol=0)
        trainer.args.kl_estimator = "k3"
        torch.testing.assert_close(loss(), trl_k3, atol=1e-7, rtol=0)
    assert trainer.beta == beta


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "extra"), [("reinforce_pp", {"num_generations": 1}), ("reinforce_pp_baseline", {})])
def test_two_step_runs(tmp_path, tiny_random_model_dir, algo, extra):
    summary = train_from_recipe(tiny_recipe(tmp_path, tiny_random_model_dir, algo, **extra), str(tmp_path / "run"),
                                show_progress=False)
    assert summary["steps"] == 2
    assert summary["trainer_config"]["num_generations"] == extra.get("num_generations", 2)
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()
    assert_saved_weights_moved(tiny_random_model_dir, tmp_path / "run" / "final")
