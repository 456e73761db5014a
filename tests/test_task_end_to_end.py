"""Code, tool calls and instructions end to end on the bundled tiny model: it cannot write Python, tool calls
or follow instructions, so its rewards are near 0; what is tested is the machinery. Two POISE steps per task
(HumanEval's programs run in the sandbox during the steps), then `poise bench` on 5 problems of each."""

from __future__ import annotations

import json

import pytest
from helpers import assert_parameters_moved, build_trainer, trainable_parameters
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.core import sandbox
from poise_trl.tasks import load_prompt_dataset

TASKS = ["humaneval", "bfcl", "ifeval"]
NO_SANDBOX = sandbox.detect_isolation() == "none"


def right_and_wrong(row: dict) -> tuple[str, str]:
    """A completion that solves the row and one that does not, written from its gold."""
    family = row["task"].split(":")[0]
    if family == "humaneval":
        entry_point = json.loads(row["verifier"])["entry_point"]
        return (f"```python\n{row['answer']}\n```",
                f"```python\ndef {entry_point}(*args, **kwargs):\n    return None\n```")
    if family == "bfcl":
        return row["answer"], '<tool_call>\n{"name": "no_such_function", "arguments": {}}\n</tool_call>'
    if family == "ifeval":  # a row whose one instruction is "no commas"
        return "A quiet harbour town with blue boats and warm bread.", "Sun, sand, and sea."
    # reasoning-gym gives partial credit to a near miss (leg_counting: 0.75 for 5001 against 500)
    answer = "<think>\n</think>\n" + ("\\boxed{{{}}}" if family == "math" else "<answer>{}</answer>")
    return answer.format(row["answer"]), answer.format("none")


def family_row(task: str) -> dict:
    rows = load_prompt_dataset(task, split="train", limit=40, seed=0)
    if task == "ifeval":
        no_commas = ["punctuation:no_comma"]
        return next(r for r in rows if json.loads(r["verifier"])["instruction_id_list"] == no_commas)
    return rows[0]


@pytest.fixture(scope="module")
def task_reward_trainer(tmp_path_factory):
    """A trainer whose only reward is `task`: TRL's `_calculate_rewards` calls it with each row's columns."""
    return build_trainer({**poise_recipe("math:toy-arith"), "rewards": ["task"], "reward_weights": [1.0]},
                         tmp_path_factory.mktemp("rewards"))


@pytest.mark.parametrize("task", [
    "math:toy-arith", "reasoning-gym:leg_counting", "bfcl", "ifeval",
    pytest.param("humaneval", marks=pytest.mark.skipif(NO_SANDBOX, reason="no sandbox isolates programs")),
])
def test_the_training_reward_path_gives_a_right_completion_1_and_a_wrong_one_0(task_reward_trainer, task):
    row = family_row(task)
    right, wrong = right_and_wrong(row)
    completions = [[{"role": "assistant", "content": text}] for text in (right, wrong)]
    tokenizer = task_reward_trainer.processing_class
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (right, wrong)]
    rewards = task_reward_trainer._calculate_rewards([row, row], [row["prompt"]] * 2, completions, ids)
    assert rewards[:, 0].tolist() == [1.0, 0.0]


def poise_recipe(task: str) -> dict:
    # The task's reward is 0 for every rollout of this model; a user reward beside it (as a TRL user would add
    # one) gives the rollouts different rewards, so the steps have a gradient and the weights move.
    return {"algo": "poise", "model": "data/tiny-qwen3", "dataset": task, "seed": 0, "dataset_size": 8,
            "rewards": ["task", "fixtures.user_rewards:vowel_share"], "reward_weights": [1.0, 0.1],
            "num_generations": 2, "per_device_train_batch_size": 8, "max_completion_length": 24,
            "learning_rate": 2e-4, "beta": 0.0, "max_steps": 2, "logging_steps": 1, "save_steps": 100,
            "probe_prompt_components": 2, "probe_response_components": 2, "probe_buffer_rows": 64,
            "probe_bootstrap_steps": 1, "eval_every": 0, "eval_limit": 2}


@pytest.mark.skipif(NO_SANDBOX, reason="neither bubblewrap nor unshare isolates here")
@pytest.mark.parametrize("task", TASKS)
def test_two_poise_steps_on_each_task_grade_every_rollout_and_move_the_weights(tmp_path, task):
    trainer = build_trainer(poise_recipe(task), tmp_path / task)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    logged = [entry for entry in trainer.state.log_history if f"rewards/task/{task}/mean" in entry]
    assert len(logged) == 2 and all("rewards/vowel_share/mean" in entry for entry in logged)
    assert all(0.0 <= entry["rewards/task_reward/mean"] <= 1.0 for entry in logged)
    assert trainer.generated_rollouts == 2 * 8


@pytest.mark.skipif(NO_SANDBOX, reason="neither bubblewrap nor unshare isolates here")
def test_bench_on_five_problems_of_each_task_scores_per_problem_and_resumes(tmp_path):
    out = tmp_path / "bench"
    args = ["bench", *TASKS, "--model", "data/tiny-qwen3", "--limit", "5", "-n", "2", "--max-new-tokens", "16",
            "--engine", "transformers", "-o", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "transformers"
    for task in TASKS:
        metrics = summary["benchmarks"][task]["metrics"]
        assert metrics["num_problems"] == 5 and metrics["num_samples"] == 2
        assert {"avg", "pass@1", "pass@2"} <= set(metrics["scores"]) and "maj" not in metrics["scores"]
        assert [p["problem"] for p in metrics["per_problem"]] == list(range(5))
        assert set(metrics["by_task"]) == {task}
        records = (out / task / "samples.jsonl").read_text().splitlines()
        assert len(records) == 10 and all(0.0 <= json.loads(r)["reward"] <= 1.0 for r in records)
    again = CliRunner().invoke(app, args)  # everything is on disk: nothing is generated again
    assert again.exit_code == 0, again.output
    assert json.loads((out / "summary.json").read_text())["engine"] is None


def test_bench_on_a_task_mix_file_prints_a_table_per_task(tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text("dataset:\n  - reasoning-gym:leg_counting\n  - {name: reasoning-gym:basic_arithmetic, weight: 2}\n")
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", str(mix), "--model", "data/tiny-qwen3", "--limit", "6", "-n", "2",
                                      "--max-new-tokens", "8", "--engine", "transformers", "-o", str(out),
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    by_task = json.loads((out / "summary.json").read_text())["benchmarks"]["mix"]["metrics"]["by_task"]
    assert {task: m["num_problems"] for task, m in by_task.items()} == {
        "reasoning-gym:leg_counting": 2, "reasoning-gym:basic_arithmetic": 4}
    assert "mix by task" in result.output
