"""POISETrainer on a 2-layer random model: the wiring, the order, checkpoints, hooks."""

from pathlib import Path

import pytest
import torch
from helpers import (
    assert_parameters_moved,
    build_trainer,
    digit_parity_reward,
    saved_tensors,
    trainable_parameters,
)

from poise_trl.probe.estimator import ProbeEstimator
from poise_trl.probe.features import RolloutFeatures, decoder_layers

REPO = Path(__file__).resolve().parents[1]


def make_trainer(model_dir, out, **overrides):
    recipe = {
        "algo": "poise", "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 64, "eval_limit": 4,
        "per_device_train_batch_size": 8, "max_completion_length": 16, "max_steps": 3, "logging_steps": 1,
        "save_steps": 1, "learning_rate": 1e-3, "seed": 0, "probe_bootstrap_steps": 1,
        "probe_prompt_components": 4, "probe_response_components": 4, "probe_buffer_rows": 64, **overrides,
    }
    return build_trainer(recipe, out, reward_funcs=[digit_parity_reward])


def random_features(n=16, d=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return RolloutFeatures(torch.randn(n, d, generator=g), torch.randn(n, d, generator=g),
                           torch.rand(n, 3, generator=g))


def test_probe_takes_over_after_bootstrap_and_invariant_holds(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "run")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    history = trainer.probe_history
    assert [h["probe_active"] for h in history] == [False, True, True]
    logged = [entry for entry in trainer.state.log_history if "probe/invariant_max_abs_error" in entry]
    assert logged and all(e["probe/invariant_max_abs_error"] == 0.0 for e in logged)
    assert any("probe/mae" in e for e in trainer.state.log_history)
    # The hook is gone once the pass is over.
    for block in decoder_layers(trainer.accelerator.unwrap_model(trainer.model)):
        assert not block._forward_hooks


def test_checkpoint_round_trip_and_resume(tmp_path, tiny_random_model_dir):
    out = tmp_path / "run"
    trainer = make_trainer(tiny_random_model_dir, out)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    features = random_features(d=trainer.model.config.hidden_size)
    final = trainer.value_estimator.predict(features)[0]
    restored = ProbeEstimator.load(out / "checkpoint-3").predict(features)[0]
    assert torch.equal(final, restored)

    # Resuming from step 2 restores the probe as it was at step 2.
    resumed = make_trainer(tiny_random_model_dir, out, max_steps=3)
    at_checkpoint = saved_tensors(out / "checkpoint-2")
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert_parameters_moved({name: at_checkpoint[name] for name in trainable_parameters(resumed)}, resumed)
    assert resumed.state.global_step == 3


def test_resume_without_probe_state_fails_loudly(tmp_path, tiny_random_model_dir):
    out = tmp_path / "run"
    make_trainer(tiny_random_model_dir, out, max_steps=1).train()
    (out / "checkpoint-1" / "poise_probe.safetensors").unlink()
    trainer = make_trainer(tiny_random_model_dir, out, max_steps=2)
    with pytest.raises(FileNotFoundError, match="no POISE probe state"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))


def test_reuses_trls_no_grad_pass_when_it_runs(tmp_path, tiny_random_model_dir):
    """With num_iterations=2 TRL computes old_per_token_logps itself: POISE adds no pass."""
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "a", num_iterations=2, max_steps=2)
    assert trainer.trl_runs_no_grad_pass()
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    # 1 generation round (2 iterations x 1 step): one no-grad pass (TRL's) + 2 training forwards.
    assert trainer.policy_forward_passes == 3
    assert trainer.feature_sources == {"trl_pass": 1, "generation": 0, "extra_pass": 0}

    plain = make_trainer(tiny_random_model_dir, tmp_path / "b", max_steps=2)
    assert not plain.trl_runs_no_grad_pass()
    before = trainable_parameters(plain)
    plain.train()
    assert_parameters_moved(before, plain)
    # 2 rounds: the features come from TRL's generate call, so 1 training forward each and nothing else.
    assert plain.policy_forward_passes == 2
    assert plain.feature_sources == {"trl_pass": 0, "generation": 2, "extra_pass": 0}


def test_works_with_a_lora_adapter(tmp_path, tiny_random_model_dir):

    trainer = make_trainer(tiny_random_model_dir, tmp_path / "lora", max_steps=2,
                           peft={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    before = trainable_parameters(trainer)
    assert before and all("lora_" in name for name in before)  # the adapter alone trains
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert [h["probe_active"] for h in trainer.probe_history] == [False, True]
    assert trainer.value_estimator.refit_count == 2
