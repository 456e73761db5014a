"""A*-PO (TRL's experimental A2POTrainer) as a poise-trl arm, on a 2-layer random model: both
stages counted exactly, V* and the filtered train set carried through a checkpoint, the budget
and LoRA refused with one line."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from helpers import (
    VARYING_REWARD,
    assert_parameters_moved,
    assert_parameters_unchanged,
    assert_saved_weights_moved,
    build_trainer,
    digit_parity_reward,
    saved_tensors,
    trainable_parameters,
)

from poise_trl.algorithms import get_algorithm
from poise_trl.algorithms.a2po import A2PO_STATE_FILE, A2POArmConfig, CountingA2POTrainer, completion_lengths
from poise_trl.run.callbacks import HeldOutEvalCallback
from poise_trl.run.recipe import RecipeError

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS, SAMPLES, BATCH = 16, 2, 8


def always_right(completions, **kwargs) -> list[float]:
    return [1.0] * len(completions)


class Recorder:
    """What the models generated and what the rewards said, kept by the test itself: every
    `generate` output of the reference model (stage 1) and the policy (stage 2), and every reward
    call with the phase it came in (stage 1 until TRL has set V*). The held-out evaluation samples
    from the policy too; those completions are no rollouts and are left out."""

    def __init__(self, reward):
        self.reward = reward
        self.trainer = None
        self.outputs = {"ref": [], "policy": []}
        self.calls = []
        self.evaluating = False

    def reward_func(self, prompts, completions, **kwargs):
        rewards = self.reward(completions)
        if self.trainer is None:  # build_run's dry call, before the trainer exists
            return rewards
        phase = "stage1" if self.trainer._optimal_values is None else "stage2"
        self.calls.append((phase, [json.dumps(p) for p in prompts], rewards))
        return rewards

    def attach(self, trainer):
        self.trainer = trainer
        for name, model in (("ref", trainer.ref_model), ("policy", trainer.model)):
            original = model.generate

            def generate(*args, _original=original, _name=name, **kwargs):
                output = _original(*args, **kwargs)
                if not self.evaluating:
                    self.outputs[_name].append(output[:, kwargs["input_ids"].shape[1]:].tolist())
                return output

            model.generate = generate
        held_out = next(c for c in trainer.callback_handler.callbacks if isinstance(c, HeldOutEvalCallback))
        evaluate = held_out._run_evaluation

        def evaluate_unrecorded(*args, **kwargs):
            self.evaluating = True
            try:
                return evaluate(*args, **kwargs)
            finally:
                self.evaluating = False

        held_out._run_evaluation = evaluate_unrecorded
        return trainer

    def tokens(self, name: str, eos: list[int]) -> list[int]:
        """Completion lengths up to and including the first EOS, in plain Python."""
        lengths = []
        for batch in self.outputs[name]:
            for ids in batch:
                ends = [i for i, token in enumerate(ids) if token in eos]
                lengths.append(ends[0] + 1 if ends else len(ids))
        return lengths


def make_trainer(model_dir, out, reward=digit_parity_reward, **overrides):
    recipe = {
        "algo": "a2po", "model": str(model_dir), "dataset": "toy-arith", "dataset_size": PROMPTS, "eval_limit": 4,
        "eval_every": 0, "per_device_train_batch_size": BATCH, "num_value_samples": SAMPLES,
        "max_completion_length": 32, "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3,
        "seed": 0, "filter_all_incorrect": False, **overrides,
    }
    recorder = Recorder(reward)
    return recorder.attach(build_trainer(recipe, out, reward_funcs=[recorder.reward_func])), recorder


def test_registered_and_lengths_stop_at_the_first_eos():
    algo = get_algorithm("a2po")
    assert algo.config_class is A2POArmConfig and algo.trainer_class is CountingA2POTrainer
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert completion_lengths(ids, [2]).tolist() == [2, 4, 1]
    assert completion_lengths(ids, [9, 8]).tolist() == [4, 4, 4]


@pytest.mark.slow
def test_both_stages_are_counted_exactly(tmp_path, tiny_random_model_dir):
    trainer, rec = make_trainer(tiny_random_model_dir, tmp_path / "run")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert trainer.state.global_step == 2
    stage1, stage2 = rec.tokens("ref", trainer.stop_token_ids), rec.tokens("policy", trainer.stop_token_ids)
    assert len(stage1) == PROMPTS * SAMPLES and len(stage2) == 2 * BATCH
    assert trainer.stage1_rollouts == PROMPTS * SAMPLES and trainer.stage1_tokens == sum(stage1)
    assert trainer.generated_rollouts == PROMPTS * SAMPLES + 2 * BATCH
    assert trainer.generated_tokens == sum(stage1) + sum(stage2)
    assert sum(stage1) < PROMPTS * SAMPLES * 32  # some completions did end at an EOS
    assert trainer.policy_forward_passes == 2

    # Zero signal, recomputed from the rewards: a stage-2 rollout has target 0 when every
    # reference sample of its prompt scored what it scored (all 1 with r = 1; all 0 with r = 0).
    stage1_rewards = defaultdict(list)
    for phase, prompts, rewards in rec.calls:
        if phase == "stage1":
            for prompt, reward in zip(prompts, rewards, strict=True):
                stage1_rewards[prompt].append(reward)
    per_step = []
    for phase, prompts, rewards in rec.calls:
        if phase == "stage2":
            per_step.append(sum(set(stage1_rewards[p]) == {r} for p, r in zip(prompts, rewards, strict=True)))
    assert len(stage1_rewards) == PROMPTS and len(per_step) == 2
    assert trainer.zero_signal_rollouts == PROMPTS * SAMPLES + sum(per_step)

    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["zero_signal_fraction"] for e in steps] == pytest.approx([n / BATCH for n in per_step])
    assert steps[0]["a2po/stage1_tokens"] == sum(stage1) and steps[0]["a2po/stage1_rollouts"] == PROMPTS * SAMPLES
    assert "a2po/stage1_tokens" not in steps[1]  # logged once
    assert [e["generated_rollouts"] for e in steps] == [PROMPTS * SAMPLES + BATCH, PROMPTS * SAMPLES + 2 * BATCH]
    assert steps[1]["generated_tokens"] == trainer.generated_tokens
    assert steps[1]["zero_signal_rollouts"] == trainer.zero_signal_rollouts


@pytest.mark.slow
def test_all_reference_samples_right_means_no_signal(tmp_path, tiny_random_model_dir):
    trainer, _ = make_trainer(tiny_random_model_dir, tmp_path / "right", reward=always_right, max_steps=1)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_unchanged(before, trainer)  # no rollout carried a signal, so no step was taken
    assert list(trainer._optimal_values.values()) == pytest.approx([1.0] * PROMPTS)  # up to float32 rounding
    (step,) = [e for e in trainer.state.log_history if "loss" in e]
    assert step["zero_signal_fraction"] == 1.0
    assert trainer.zero_signal_rollouts == trainer.generated_rollouts == PROMPTS * SAMPLES + BATCH


@pytest.mark.slow
def test_resume_keeps_v_star_and_the_filtered_train_set(tmp_path, tiny_random_model_dir):
    # With the filter on, prompts whose 2 reference samples both scored 0 leave the train set.
    settings = {"save_strategy": "steps", "save_steps": 1, "filter_all_incorrect": True}
    straight, _ = make_trainer(tiny_random_model_dir, tmp_path / "straight", **settings)
    before = trainable_parameters(straight)
    straight.train()
    assert_parameters_moved(before, straight)
    kept = len(straight.train_dataset)
    assert BATCH < kept < PROMPTS
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    state = json.loads((checkpoint / A2PO_STATE_FILE).read_text())
    assert state["optimal_values"] == straight._optimal_values
    assert state["generated_rollouts"] == PROMPTS * SAMPLES + BATCH and len(state["train_prompts"]) == kept

    resumed, rec = make_trainer(tiny_random_model_dir, tmp_path / "resumed", **settings)
    at_checkpoint = saved_tensors(checkpoint)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_parameters_moved({name: at_checkpoint[name] for name in trainable_parameters(resumed)}, resumed)
    assert rec.outputs["ref"] == []  # stage 1 did not sample again
    assert resumed._optimal_values == straight._optimal_values  # the same floats, through JSON
    assert [r["prompt"] for r in resumed.train_dataset] == [r["prompt"] for r in straight.train_dataset]
    assert (resumed.stage1_tokens, resumed.stage1_rollouts) == (straight.stage1_tokens, straight.stage1_rollouts)
    # the counters continue from the checkpoint: stage 1 once, then the step the resumed run took
    assert resumed.generated_rollouts == straight.generated_rollouts == PROMPTS * SAMPLES + BATCH + (kept - BATCH)
    assert resumed.generated_tokens == state["generated_tokens"] + sum(rec.tokens("policy", resumed.stop_token_ids))
    assert resumed.zero_signal_rollouts >= PROMPTS * SAMPLES

    (checkpoint / A2PO_STATE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=A2PO_STATE_FILE):
        trainer = make_trainer(tiny_random_model_dir, tmp_path / "again", **settings)[0]
        trainer.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow
def test_a_budget_stage_1_cannot_fit_is_one_line(tmp_path, tiny_random_model_dir):
    # rollouts: known before sampling, refused when the trainer is built (poise train has written nothing)
    with pytest.raises(RecipeError) as caught:
        make_trainer(tiny_random_model_dir, tmp_path / "r", budget_rollouts=20)
    message = str(caught.value)
    assert "\n" not in message and "32 rollouts" in message and "20" in message and "dataset_size" in message
    # tokens: whether up to 32 x 32 fit in 40 only sampling shows; stage 1 stops at its first batch past them
    with pytest.warns(UserWarning, match="may use up to 1024 of the 40 budget tokens"):
        trainer, rec = make_trainer(tiny_random_model_dir, tmp_path / "t", budget_tokens=40)
    with pytest.raises(RecipeError) as caught:
        trainer.train()
    message = str(caught.value)
    spent = sum(rec.tokens("ref", trainer.stop_token_ids))
    assert "\n" not in message and f"{spent} generated tokens after {BATCH} of {PROMPTS} prompts" in message
    assert "budget_tokens is 40" in message and "num_value_samples" in message
    assert len(rec.outputs["ref"]) == 1 and rec.outputs["policy"] == []  # stopped after its first batch


def test_lora_is_refused(tmp_path, tiny_random_model_dir):
    with pytest.raises(ValueError, match="does not support LoRA"):
        make_trainer(tiny_random_model_dir, tmp_path / "lora", peft={"r": 4})


@pytest.mark.slow
def test_poise_train_budget_run_counts_stage_1_and_resumes(tmp_path, tiny_random_model_dir):
    """Through `train_from_recipe`: stage 1 is on the curve's axes (rollouts and seconds) from the
    first point; a run cut after checkpoint-1 resumes to the same end without sampling stage 1 again."""
    import shutil

    from poise_trl.run.train import train_from_recipe

    budget = PROMPTS * SAMPLES + 2 * BATCH  # stage 1, then two steps
    recipe = {
        "algo": "a2po", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": PROMPTS,
        "eval_limit": 4, "eval_every": 0, "eval_num_samples": 1, "eval_max_new_tokens": 8,
        "per_device_train_batch_size": BATCH, "num_value_samples": SAMPLES, "max_completion_length": 16,
        "filter_all_incorrect": False, "max_steps": 100, "logging_steps": 1, "save_steps": 1, "learning_rate": 1e-3,
        "seed": 0, "budget_rollouts": budget, "budget_eval_points": 2, "rewards": [VARYING_REWARD],
    }
    whole = train_from_recipe(recipe, str(tmp_path / "whole"), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, tmp_path / "whole" / "final")
    assert whole["steps"] == 2 and whole["budget_reached"] and whole["generated_rollouts"] == budget
    points = whole["heldout_history"]
    assert [(p["step"], p["generated_rollouts"]) for p in points] == [(0, 32), (1, 40), (2, 48)]
    assert 0 < points[0]["train_seconds"] < points[1]["train_seconds"]  # stage 1's seconds count
    assert whole["generation"]["policy_forward_passes"] == 2
    logged = [e for e in whole["train_log"] if "loss" in e]
    assert logged[0]["a2po/stage1_rollouts"] == 32 and "zero_signal_fraction" in logged[1]

    out = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", out)
    for name in ("summary.json", "final", "checkpoint-2"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    resumed = train_from_recipe(recipe, str(out), show_progress=False)
    assert resumed["resumed_at_steps"] == [1]
    assert (resumed["steps"], resumed["generated_rollouts"]) == (2, budget)
    assert resumed["generated_tokens"] == whole["generated_tokens"]
    assert [p["accuracy"] for p in resumed["heldout_history"]] == [p["accuracy"] for p in points]
