"""`log_completions: true`: the completion table (poise_trl/algorithms/completions.py) in completions.jsonl and in
TRL's tracker table, for POISE (with its probe baseline), GRPO on a task mix (with the task) and every other
GRPO-based algorithm; a resumed run rewrites the steps after its checkpoint instead of repeating them."""

import json
from collections import defaultdict

import pandas as pd
import pytest
from helpers import assert_parameters_moved, build_trainer, digit_parity_reward, trainable_parameters

from poise_trl.core.completions import COMPLETIONS_FILE, truncate_after

CHAIN_SUM, LEG_COUNTING = "reasoning-gym:chain_sum", "reasoning-gym:leg_counting"
SHORT_PROMPT = {"system_prompt": "direct"}


def read_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]


def by_step(rows: list[dict]) -> dict[int, list[dict]]:
    steps = defaultdict(list)
    for row in rows:
        steps[row["step"]].append(row)
    return dict(steps)


def logged_by_step(trainer, key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


def tracker_table(out, step: int) -> pd.DataFrame:
    """The table TRL sends to wandb/trackio at `step` (it saves the same DataFrame as parquet)."""
    return pd.read_parquet(out / "completions" / f"completions_{step:05d}.parquet")


def tiny_recipe(model_dir, algo, **extra):
    return {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 64, "eval_limit": 4,
        "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 12, "max_steps": 1,
        "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0, "log_completions": True,
        "num_completions_to_print": 1, **extra,
    }


def test_truncate_after_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / COMPLETIONS_FILE
    lines = [json.dumps({"step": step, "completion": f"c{step}"}) + "\n" for step in (1, 1, 2, 3)]
    path.write_text("".join(lines) + '{"step": 4, "compl')
    truncate_after(path, 2)
    assert path.read_text() == "".join(lines[:3])
    truncate_after(tmp_path / "absent.jsonl", 2)  # a run without the table: nothing to do
    assert not (tmp_path / "absent.jsonl").exists()


@pytest.mark.slow
def test_poise_rows_hold_reward_equal_baseline_plus_advantage_and_a_resume_does_not_repeat_them(
        tmp_path, tiny_random_model_dir):
    out = tmp_path / "run"
    recipe = tiny_recipe(tiny_random_model_dir, "poise", num_generations=2, max_steps=3, save_strategy="steps",
                         save_steps=1, probe_bootstrap_steps=1, probe_prompt_components=4,
                         probe_response_components=4, probe_buffer_rows=64)
    trainer = build_trainer(recipe, out, reward_funcs=[digit_parity_reward])
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)

    rows = read_rows(out)
    steps = by_step(rows)
    assert {step: len(group) for step, group in steps.items()} == {1: 8, 2: 8, 3: 8}
    assert {"step", "prompt", "completion", "reward", "advantage", "baseline"} == set(rows[0])
    for row in rows:  # POISE's invariant A = r - b, row by row
        assert row["reward"] == pytest.approx(row["baseline"] + row["advantage"], abs=1e-6)
    rewards = logged_by_step(trainer, "reward")
    for step, group in steps.items():
        assert sum(row["reward"] for row in group) / len(group) == pytest.approx(rewards[step], abs=1e-6)
    # Steps 2-3 use the probe: baselines that are not the other rollout's reward (RLOO's, step 1).
    assert any(row["baseline"] not in (0.0, 1.0) for row in steps[3])
    table = tracker_table(out, 3)
    assert table["advantage"].tolist() == pytest.approx([row["advantage"] for row in steps[3]])
    assert table["baseline"].tolist() == pytest.approx([row["baseline"] for row in steps[3]])

    resumed = build_trainer({**recipe, "max_steps": 3}, out, reward_funcs=[digit_parity_reward])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    again = read_rows(out)
    assert [row["step"] for row in again] == [1] * 8 + [2] * 8 + [3] * 8
    assert again == rows  # the resumed run generates step 3 as the uninterrupted one did


@pytest.mark.slow
def test_grpo_on_a_mix_tables_each_rows_task_and_no_baseline(tmp_path, tiny_random_model_dir):
    mix = [{"name": CHAIN_SUM, "config": SHORT_PROMPT}, {"name": LEG_COUNTING, "config": SHORT_PROMPT}]
    out = tmp_path / "run"
    trainer = build_trainer(tiny_recipe(tiny_random_model_dir, "grpo", dataset=mix, dataset_size=16, eval_limit=2,
                                        max_steps=2), out, reward_funcs=[digit_parity_reward])
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)

    rows = read_rows(out)
    assert {"step", "prompt", "completion", "reward", "advantage", "task"} == set(rows[0])
    for step, group in by_step(rows).items():
        for task in {row["task"] for row in group}:
            rewards = [row["reward"] for row in group if row["task"] == task]
            mean = sum(rewards) / len(rewards)
            assert mean == pytest.approx(logged_by_step(trainer, f"rewards/task/{task}/mean")[step], abs=1e-6)
        for start in range(0, len(group), 4):  # GRPO: each prompt's advantages centred on its mean
            prompt_group = group[start : start + 4]
            assert len({json.dumps(row["prompt"]) for row in prompt_group}) == 1
            assert sum(row["advantage"] for row in prompt_group) == pytest.approx(0.0, abs=1e-5)
    assert {row["task"] for row in rows} == {CHAIN_SUM, LEG_COUNTING}
    assert tracker_table(out, 2)["task"].tolist() == [row["task"] for row in by_step(rows)[2]]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "dapo", "reinforce_pp", "asyppo", "vapo"])
def test_every_grpo_based_algorithm_writes_the_table_with_its_own_advantages(tmp_path, tiny_random_model_dir, algo):
    out = tmp_path / "run"
    extra = {"value_warmup_steps": 0} if algo == "vapo" else {}  # the actor trains from the first step
    trainer = build_trainer(tiny_recipe(tiny_random_model_dir, algo, **extra), out, reward_funcs=[digit_parity_reward])
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    rows = read_rows(out)
    assert [row["step"] for row in rows] == [1] * 8 and "baseline" not in rows[0]
    assert sum(row["reward"] for row in rows) / 8 == pytest.approx(logged_by_step(trainer, "reward")[1], abs=1e-6)
    # The table carries the trainer's advantages, not the group-normalized ones TRL computed first.
    assert tracker_table(out, 1)["advantage"].tolist() == pytest.approx([row["advantage"] for row in rows])
    if algo == "rloo":
        for i, row in enumerate(rows):
            others = [r["reward"] for r in rows[i // 4 * 4 : i // 4 * 4 + 4] if r is not row]
            assert row["advantage"] == pytest.approx(row["reward"] - sum(others) / 3, abs=1e-6)


@pytest.mark.slow
def test_a2po_rows_hold_its_optimal_value_baseline(tmp_path, tiny_random_model_dir):
    """A*-PO (TRL's A2POTrainer, no tracker table): completions.jsonl rows carry V*(x) as the baseline and
    r - V*(x) as the advantage, V* being stage 1's estimate for that prompt."""
    out = tmp_path / "run"
    recipe = {
        "algo": "a2po", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 8,
        "eval_limit": 4, "eval_every": 0, "per_device_train_batch_size": 4, "num_value_samples": 4,
        "max_completion_length": 12, "max_steps": 2, "logging_steps": 1, "save_strategy": "no",
        "learning_rate": 1e-3, "seed": 0, "filter_all_incorrect": False, "log_completions": True,
    }
    trainer = build_trainer(recipe, out, reward_funcs=[digit_parity_reward])
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    rows = read_rows(out)
    assert [row["step"] for row in rows] == [1] * 4 + [2] * 4
    v_star = {json.dumps(key) if not isinstance(key, str) else key: value
              for key, value in trainer._optimal_values.items()}
    for row in rows:
        assert row["advantage"] == pytest.approx(row["reward"] - row["baseline"], abs=1e-6)
        assert 0.0 <= row["baseline"] <= 1.0 and row["completion"] and row["prompt"]
    assert {round(row["baseline"], 6) for row in rows} <= {round(v, 6) for v in v_star.values()}
    for step, group in by_step(rows).items():
        logged = logged_by_step(trainer, "reward")[step]
        assert sum(row["reward"] for row in group) / 4 == pytest.approx(logged, abs=1e-6)
