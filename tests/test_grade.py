"""`poise grade`: existing completions scored by each row's own verifier (HumanEval's tests in the sandbox, a
reasoning-gym generator's `score_answer`, math-verify for math rows), mean reward per task, rewards per line."""

from __future__ import annotations

import json

import typer
from helpers import assert_one_line_error
from typer.testing import CliRunner

from poise_trl.cli.grade import grade as grade_command
from poise_trl.tasks import task_rows

runner = CliRunner()


def cli(*args):
    app = typer.Typer()
    app.command()(grade_command)
    result = runner.invoke(app, [str(a) for a in args])
    return result, result.output


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(tmp_path):
    rows = task_rows("humaneval", "test", 4, 0)
    completions = [{"index": i, "completion": f"```python\n{row['answer']}\n```"} for i, row in enumerate(rows)]
    completions += [{"index": i, "completion": "```python\ndef nothing():\n    return None\n```"}
                    for i in range(len(rows))]
    path = write_jsonl(tmp_path / "completions.jsonl", completions)
    result, output = cli("humaneval", "--limit", 4, "--completions", path)
    assert result.exit_code == 0, output
    graded = read_jsonl(tmp_path / "completions.jsonl.graded.jsonl")
    assert [g["reward"] for g in graded] == [1.0] * 4 + [0.0] * 4
    assert [g["index"] for g in graded] == [0, 1, 2, 3] * 2 and {g["task"] for g in graded} == {"humaneval"}
    summary = json.loads((tmp_path / "completions.jsonl.graded.jsonl.summary.json").read_text())
    assert summary["by_task"]["humaneval"] == {"completions": 8, "mean_reward": 0.5, "correct": 0.5}


def test_reasoning_gym_completions_in_row_order_and_a_math_file(tmp_path):
    rows = task_rows("reasoning-gym:leg_counting", "test", 3, 5)
    texts = [f"<answer>{rows[0]['answer']}</answer>", "<answer>-1</answer>", f"<answer>{rows[2]['answer']}</answer>"]
    path = write_jsonl(tmp_path / "rg.jsonl", [{"completion": t} for t in texts])
    out = tmp_path / "graded.jsonl"
    result, output = cli("reasoning-gym:leg_counting", "--limit", 3, "--seed", 5, "-c", path, "-o", out)
    assert result.exit_code == 0, output
    assert [g["reward"] for g in read_jsonl(out)] == [1.0, 0.0, 1.0]
    assert "reasoning-gym:leg_counting" in output and "0.667" in output

    data = write_jsonl(tmp_path / "math.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])
    answers = write_jsonl(tmp_path / "answers.jsonl", [{"completion": "so \\boxed{2}"}, {"completion": "\\boxed{5}"}])
    result, output = cli("mine", "--data-file", data, "-c", answers, "-o", tmp_path / "math_graded.jsonl")
    assert result.exit_code == 0, output
    assert [g["correct"] for g in read_jsonl(tmp_path / "math_graded.jsonl")] == [True, False]


def test_mismatched_or_broken_completion_files_give_one_line_and_keep_what_exists(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"completion": "<answer>1</answer>"}])
    assert_one_line_error(*cli("reasoning-gym:leg_counting", "--limit", 3, "-c", path),
                          "1 completions for 3 dataset rows")
    path.write_text('{"completion": "a"}\nnot json\n')
    assert_one_line_error(*cli("reasoning-gym:leg_counting", "--limit", 2, "-c", path), "line 2 is not JSON")
    write_jsonl(path, [{"index": 7, "completion": "x"}])
    assert_one_line_error(*cli("reasoning-gym:leg_counting", "--limit", 2, "-c", path), "index 7 is not a row")
    assert_one_line_error(*cli("reasoning-gym:leg_countin", "--limit", 2, "-c", path), "leg_counting")

    write_jsonl(path, [{"completion": "<answer>1</answer>"}, {"completion": "<answer>2</answer>"}])
    out = tmp_path / "done.jsonl"
    out.write_text("finished work\n")
    assert_one_line_error(*cli("reasoning-gym:leg_counting", "--limit", 2, "-c", path, "-o", out), "exists")
    assert out.read_text() == "finished work\n"


def test_a_task_mix_is_graded_per_task(tmp_path):
    """`+` joins task names into a mix of equal weights (a YAML file with a `dataset:` list works too)."""
    from poise_trl.bench_data import DataRequest, load_benchmark

    mix = "reasoning-gym:leg_counting+reasoning-gym:basic_arithmetic"
    rows = load_benchmark(mix, None, DataRequest(limit=4), seed=0)
    assert sorted(set(rows["task"])) == ["reasoning-gym:basic_arithmetic", "reasoning-gym:leg_counting"]
    path = write_jsonl(tmp_path / "mix.jsonl", [{"completion": f"<answer>{answer}</answer>"} for answer in rows["answer"]])
    result, output = cli(mix, "--limit", 4, "-c", path)
    assert result.exit_code == 0, output
    summary = json.loads((tmp_path / "mix.jsonl.graded.jsonl.summary.json").read_text())
    assert {task: stats["mean_reward"] for task, stats in summary["by_task"].items()} == {
        "reasoning-gym:leg_counting": 1.0, "reasoning-gym:basic_arithmetic": 1.0}
    assert "reasoning-gym:basic_arithmetic" in output and "all" in output
