"""AsyPPOTrainer (asyppo / ppo / vapo) on a 2-layer random model: wiring, warm-up, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_parameters_moved, build_trainer, saved_tensors, trainable_parameters

from poise_trl.algorithms.critics import CriticEnsemble
from poise_trl.run.recipe import parse_recipe


def always_right(completions, **kwargs):
    return [1.0] * len(completions)


def parity(completions, **kwargs):
    """A reward that varies, so the critics' targets do (the random model never solves a problem)."""
    return [float(len(str(c)) % 2) for c in completions]


def make_trainer(model_dir, out, algo="asyppo", reward_funcs=None, **overrides):
    recipe = {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 64, "eval_limit": 4,
        "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 12, "max_steps": 2,
        "logging_steps": 1, "save_steps": 1, "learning_rate": 1e-3, "critic_learning_rate": 1e-3, "seed": 0,
        **overrides,
    }
    return build_trainer(recipe, out, reward_funcs=reward_funcs)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


def test_two_step_asyppo_run(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "run", reward_funcs=[parity], critic_values="cross_fit")
    seen = []
    compute = trainer.compute_advantages

    def spy(rewards, output):
        advantages = compute(rewards, output)
        seen.append((advantages, output))
        return advantages

    trainer.compute_advantages = spy
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert trainer.state.global_step == 2 and trainer.critics.updates == 2
    advantages, output = seen[0]
    mask = output["completion_mask"].bool()
    assert advantages.shape == mask.shape  # per-token advantages for TRL's loss
    assert (advantages[~mask] == 0).all()
    # AsyPPO paper, I^A: about 20% of the valid tokens (the lowest critic stds) carry no advantage.
    assert 0 < (advantages[mask] == 0).float().mean() <= 0.25
    assert output["entropy_filter"].shape == mask.shape and output["entropy_filter"][~mask].sum() == 0
    for key in ("critic/value_loss", "critic/explained_variance", "critic/std_p50", "asyppo/adv_masked_fraction",
                "asyppo/entropy_filtered_fraction", "asyppo/entropy_kept", "entropy"):
        assert logged(trainer, key), key
    # rank selection: floor(0.2 * n) tokens, ties or not
    assert all(0.19 <= f <= 0.2 for f in logged(trainer, "asyppo/adv_masked_fraction"))
    for key in ("critic/explained_variance_prior", "critic/mc_sign_agreement", "advantages/raw_std"):
        assert logged(trainer, key), key
    # the critic report: one record per round, out-of-sample and used values, a plot
    report = json.loads((tmp_path / "run" / "critic_report.json").read_text())
    assert report["rounds"] == 2 and len(report["per_round"]) == 2
    assert {"explained_variance", "explained_variance_prior", "mc_sign_agreement"} <= set(report["per_round"][0])
    assert sum(b["count"] for b in report["calibration_used"]) == 16  # V(s_0) of 8 rows x 2 rounds
    assert (tmp_path / "run" / "critic_values.png").stat().st_size > 0


def test_registry_defaults_give_asyppo_ppo_and_vapo(tmp_path):
    def config(algo, **kwargs):
        return parse_recipe({"algo": algo, **kwargs}, str(tmp_path)).args

    asyppo, ppo, vapo = config("asyppo"), config("ppo"), config("vapo", per_device_train_batch_size=16)
    assert (asyppo.num_critics, asyppo.adv_mask_fraction, asyppo.entropy_filter_fraction) == (2, 0.2, 0.2)
    assert (ppo.num_critics, ppo.lambda_policy, ppo.lambda_critic, ppo.loss_type) == (1, 0.95, 0.95, "grpo")
    assert (vapo.num_critics, vapo.lambda_critic, vapo.length_adaptive_alpha) == (1, 1.0, 0.05)
    assert (vapo.epsilon, vapo.epsilon_high, vapo.loss_type, vapo.positive_lm_coef) == (0.2, 0.28, "dapo", 0.1)
    assert vapo.value_warmup_steps == 50 and vapo.num_generations == 16
    from poise_trl.run.recipe import RecipeError

    with pytest.raises(RecipeError, match="needs num_critics >= 2"):
        config("ppo", adv_mask_fraction=0.2)
    with pytest.raises(RecipeError, match="multiple of num_critics"):
        config("asyppo", num_generations=6, per_device_train_batch_size=6, num_critics=4)
    with pytest.raises(RecipeError, match="critic_aggregation"):
        config("asyppo", critic_aggregation="max")
    with pytest.raises(RecipeError, match="OTHER critics"):
        config("ppo", critic_values="cross_fit")
    with pytest.raises(RecipeError, match="critic_values"):
        config("asyppo", critic_values="latest")


def test_value_warmup_freezes_the_actor_and_positive_lm_loss(tmp_path, tiny_random_model_dir):
    from transformers import TrainerCallback

    trainer = make_trainer(tiny_random_model_dir, tmp_path / "run", algo="vapo", value_warmup_steps=1,
                           reward_funcs=[always_right], save_steps=100)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    unchanged = {}

    class AfterEachStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            unchanged[state.global_step] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    trainer.add_callback(AfterEachStep())
    trainer.train()
    # Step 1 trains the critic only (not even weight decay touches the actor); step 2 moves it.
    assert unchanged == {1: True, 2: False}
    assert trainer.critics.updates == 2 and logged(trainer, "vapo/actor_frozen") == [1.0, 0.0]
    # Every response is right: the NLL term is the mean -log p over all completion tokens,
    # about log(vocab) ~ 4.6 for the random model, whatever the batch split.
    nll = logged(trainer, "vapo/positive_nll")
    assert len(nll) == 1 and 3.5 < nll[0] < 6.0
    assert logged(trainer, "vapo/positive_fraction") == [1.0, 1.0]


def test_checkpoint_round_trip_and_resume(tmp_path, tiny_random_model_dir):
    out = tmp_path / "run"
    trainer = make_trainer(tiny_random_model_dir, out, algo="ppo", num_generations=2)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    saved = CriticEnsemble(str(tiny_random_model_dir), 1, learning_rate=1e-3)
    saved.load(out / "checkpoint-2" / "critics")
    ids = torch.randint(10, 60, (3, 12))
    mask = torch.ones_like(ids)
    assert torch.equal(saved.values(ids, mask, 5), trainer.critics.values(ids, mask, 5))

    resumed = make_trainer(tiny_random_model_dir, out, algo="ppo", num_generations=2)
    at_checkpoint = saved_tensors(out / "checkpoint-1")
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert_parameters_moved({name: at_checkpoint[name] for name in trainable_parameters(resumed)}, resumed)
    # 1 update restored from the checkpoint + 1 new round; a fresh critic would count 1.
    assert resumed.state.global_step == 2 and resumed.critics.updates == 2


def test_resume_without_critic_state_fails_loudly(tmp_path, tiny_random_model_dir):
    out = tmp_path / "run"
    make_trainer(tiny_random_model_dir, out, max_steps=1).train()
    (out / "checkpoint-1" / "critics" / "state.json").unlink()
    trainer = make_trainer(tiny_random_model_dir, out)
    with pytest.raises(FileNotFoundError, match="no critic state"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
