"""Dataset loading: registry, local files in every supported format, column detection and its errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from conftest import SHARED_DATA, needs_shared_data

from poise_trl.tasks import load_prompt_dataset, toy_task
from poise_trl.tasks.math_grader import is_correct
from poise_trl.tasks.prompts import (
    DATASETS,
    SPREAD_EVAL_SEED,
    SPREAD_EVAL_SIZE,
    TOY_EVAL_FILE,
    DatasetFormatError,
    DatasetSpec,
    DatasetUnavailableError,
    held_out_split,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user_text(row: dict) -> str:
    return row["prompt"][-1]["content"]


@needs_shared_data
@pytest.mark.parametrize(
    "name, rows, extra",
    [("aime24", 30, "id"), ("aime25", 30, "id"), ("amc23", 40, "url"), ("math500", 500, "level")],
)
def test_benchmark_files_load(name, rows, extra):
    ds = load_prompt_dataset(SHARED_DATA / name / "test.jsonl", prompt_suffix="Put the answer in \\boxed{}.")
    assert len(ds) == rows
    assert extra in ds.column_names
    for row in ds:
        assert isinstance(row["answer"], str) and row["answer"].strip()
        assert row["prompt"][-1]["role"] == "user"
        assert user_text(row).endswith("\nPut the answer in \\boxed{}.")


@needs_shared_data
def test_float_answers_become_integers():
    aime25 = load_prompt_dataset(SHARED_DATA / "aime25")  # a directory holding one file works too
    assert aime25[0]["answer"] == "70"
    assert all("." not in answer for answer in aime25["answer"])


@needs_shared_data
def test_math500_gold_grades_against_itself():
    """Cross-checks data and rewards: every MATH-500 gold, boxed, must be graded correct against itself."""
    ds = load_prompt_dataset(SHARED_DATA / "math500")
    answers = list(ds["answer"])
    assert [a for a in answers if not is_correct(f"\\boxed{{{a}}}", a)] == []
    # ... and the grader is not trivially true: a neighbour's answer is almost never accepted.
    shifted = [(a, b) for a, b in zip(answers, answers[1:] + answers[:1], strict=True) if a != b]
    accepted = [(a, b) for a, b in shifted if is_correct(f"\\boxed{{{b}}}", a)]
    assert len(accepted) < 0.02 * len(shifted), accepted


def test_missing_columns_error_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "What is 1+1?", "label": "2"}])
    with pytest.raises(DatasetFormatError) as error:
        load_prompt_dataset(path)
    message = str(error.value)
    assert "bad.jsonl" in message and "'text'" in message and "'label'" in message
    assert "dataset_columns" in message


def test_missing_answer_only(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 1+1?", "label": "2"}])
    with pytest.raises(DatasetFormatError, match="no answer column"):
        load_prompt_dataset(path)


def test_explicit_column_mapping(tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl", [{"text": "What is 1+1?", "label": 2, "source": "x"}])
    ds = load_prompt_dataset(path, columns={"question": "text", "answer": "label"}, system_prompt="Be brief.")
    assert ds[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
    ]
    assert ds[0]["answer"] == "2"
    assert ds[0]["source"] == "x"
    with pytest.raises(DatasetFormatError, match="bad column mapping"):
        load_prompt_dataset(path, columns={"question": "nope"})


def test_answers_from_boxed_solutions(tmp_path, caplog):
    rows = [
        {"problem": "p1", "solution": "so \\boxed{\\frac{1}{2}}."},
        {"problem": "p2", "solution": "\\boxed{3}"},
    ]
    ds = load_prompt_dataset(write_jsonl(tmp_path / "s.jsonl", rows))
    assert list(ds["answer"]) == ["\\frac{1}{2}", "3"]
    assert "solution" not in ds.column_names
    rows += [{"problem": "p3", "solution": "it is 4"}, {"problem": "p4", "solution": "no box"}]
    ds = load_prompt_dataset(write_jsonl(tmp_path / "s2.jsonl", rows))
    assert list(ds["answer"]) == ["\\frac{1}{2}", "3"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "skipped 2 of 4 rows (2 with no \\boxed{} answer in 'solution'; rows 3, 4, counting from 1)" in warning


def test_bad_rows_are_skipped_with_one_warning(tmp_path, caplog):
    """Empty answers, empty questions and broken JSON lines: skipped, counted, the first rows named."""
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    rows[1]["answer"] = ""
    rows[4]["question"] = None
    for i in (6, 7, 8, 9):
        rows[i]["answer"] = None
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    path.write_text(path.read_text() + "{not json\n")
    ds = load_prompt_dataset(path, column_option="--{role}-column COLUMN")
    assert list(ds["answer"]) == ["0", "2", "3", "5"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "skipped 7 of 11 rows (1 with an unreadable line, 1 with an empty or non-text question in 'question', " \
        "5 with no usable answer in 'answer'; rows 2, 5, 7, 8, 9, ..., counting from 1)" in warnings[0]
    assert "--answer-column COLUMN" in warnings[0]


def test_nothing_usable_is_fatal(tmp_path):
    rows = [{"question": "q1", "answer": ""}, {"question": "q2", "answer": None}]
    with pytest.raises(DatasetFormatError, match="no usable row: 2 of 2 rows") as error:
        load_prompt_dataset(write_jsonl(tmp_path / "e.jsonl", rows))
    assert "\n" not in str(error.value) and "dataset_columns" in str(error.value)


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetFormatError, match="empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    datasets.Dataset.from_dict({"question": [], "answer": []}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(DatasetFormatError, match="empty"):
        load_prompt_dataset(tmp_path / "empty.parquet")


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset("no/such/file.jsonl")


@pytest.mark.parametrize("suffix", [".parquet", ".json", ".csv"])
def test_formats_round_trip(tmp_path, suffix):
    source = datasets.Dataset.from_dict(
        {"problem": ["What is 2+2?", "What is 3+3?"], "answer": ["4", "6"], "level": [1, 2]}
    )
    path = tmp_path / f"train{suffix}"
    {".parquet": source.to_parquet, ".json": source.to_json, ".csv": source.to_csv}[suffix](str(path))
    ds = load_prompt_dataset(path, prompt_suffix="Box it.")
    assert list(ds["answer"]) == ["4", "6"]
    assert list(ds["level"]) == [1, 2]
    assert ds[1]["prompt"] == [{"role": "user", "content": "What is 3+3?\nBox it."}]


def test_directory_with_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "answer": "1"}])
    write_jsonl(tmp_path / "test.jsonl", [{"question": "b", "answer": "2"}, {"question": "c", "answer": "3"}])
    assert len(load_prompt_dataset(tmp_path, split="test")) == 2
    with pytest.raises(DatasetFormatError, match="split"):
        load_prompt_dataset(tmp_path)


def test_conversational_prompt_kept(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 1+1?"}]
    ds = load_prompt_dataset(
        write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": 2}]), prompt_suffix="x"
    )
    assert ds[0]["prompt"] == chat
    assert ds[0]["answer"] == "2"


def test_limit_is_a_seeded_subset_in_order(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    first = list(load_prompt_dataset(path, limit=10, seed=1)["answer"])
    assert first == list(load_prompt_dataset(path, limit=10, seed=1)["answer"])
    assert first != list(load_prompt_dataset(path, limit=10, seed=2)["answer"])
    assert [int(a) for a in first] == sorted(int(a) for a in first)


def test_toy_arith_train_is_seeded():
    default = load_prompt_dataset("toy-arith")
    assert len(default) == 4000
    assert {"prompt", "answer", "level"} <= set(default.column_names)
    same = load_prompt_dataset("toy-arith", limit=100, seed=0)
    other = load_prompt_dataset("toy-arith", limit=100, seed=1)
    assert list(same["answer"]) == list(default["answer"][:100])
    assert list(same["answer"]) != list(other["answer"])
    expected = toy_task.generate_problems(100, seed=0)
    assert [user_text(row) for row in same] == [p["question"] for p in expected]


def test_toy_arith_eval_split():
    assert held_out_split("toy-arith") == "test"
    ds = load_prompt_dataset("toy-arith", split=held_out_split("toy-arith"))
    assert len(ds) == 200
    assert sorted(set(ds["level"])) == [1, 2, 3, 4]
    assert TOY_EVAL_FILE.is_file()
    # The shipped answers are right, so a perfect policy scores 1.0.
    assert all(is_correct(f"\\boxed{{{a}}}", a) for a in ds["answer"][:20])


def test_toy_arith_spread_train_and_shipped_eval_come_from_the_generator():
    train = load_prompt_dataset("toy-arith-spread", limit=60, seed=3)
    assert sorted(set(train["level"])) == [1, 2, 3, 4, 5, 6]
    assert [user_text(row) for row in train] == [p["question"] for p in toy_task.generate_spread_problems(60, seed=3)]
    assert held_out_split("toy-arith-spread") == "test"
    held_out = load_prompt_dataset("toy-arith-spread", split="test")
    expected = toy_task.generate_spread_problems(SPREAD_EVAL_SIZE, SPREAD_EVAL_SEED)
    assert [user_text(row) for row in held_out] == [p["question"] for p in expected]
    assert list(held_out["answer"]) == [p["answer"] for p in expected]
    assert list(held_out["level"]) == [p["level"] for p in expected]
    six_digits = held_out.filter(lambda row: row["level"] == 6)
    assert all(len(answer) >= 6 for answer in six_digits["answer"])


def test_toy_arith_level_out_of_range_is_refused():
    import random

    with pytest.raises(ValueError, match="between 1 and 9 digits, got 0"):
        toy_task.make_problem(random.Random(0), 0)


def test_registry_entries():
    assert {"toy-arith", "dapo-math-17k", "math-500", "aime24", "aime25", "amc23"} <= set(DATASETS)
    assert held_out_split("math-500") == "test"
    assert held_out_split("dapo-math-17k") is None
    with pytest.raises(ValueError, match="registered datasets"):
        held_out_split("gsm9k")


def test_dapo_schema(tmp_path):
    """DAPO's `solution` holds the bare answer and its prompt carries "Answer:" instructions we strip."""
    problem = "Find $x$ if $x + 1 = 35$."
    prompt = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        f'{problem}\n\nRemember to put your answer on its own line after "Answer:".'
    )
    spec = DATASETS["dapo-math-17k"]
    path = tmp_path / "dapo.parquet"
    datasets.Dataset.from_dict(
        {"prompt": [prompt], "solution": ["34"], "data_source": ["math_dapo"]}
    ).to_parquet(path)
    ds = load_prompt_dataset(path, columns=spec.columns)
    assert ds[0]["answer"] == "34"
    assert spec.clean_question(prompt) == problem
    assert spec.clean_question(problem) == problem


def test_hub_offline_gives_clear_error(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match="local .jsonl"):
        load_prompt_dataset("poise-trl-tests/not-a-cached-dataset")
    monkeypatch.setitem(
        DATASETS, "fake-bench", DatasetSpec("x", hub_id="poise-trl-tests/fake-bench", split="test")
    )
    with pytest.raises(DatasetUnavailableError, match="poise-trl-tests/fake-bench"):
        load_prompt_dataset("fake-bench")
    assert time.monotonic() - start < 30


def test_folder_layouts(tmp_path):
    """MATH's per-problem files under train/ and test/, a {"data": [...]} JSON file, a save_to_disk DatasetDict."""
    for split, answer in (("train", "1"), ("test", "2")):
        (tmp_path / "MATH" / split / "algebra").mkdir(parents=True)
        (tmp_path / "MATH" / split / "algebra" / "5.json").write_text(
            json.dumps({"problem": f"p {split}", "level": "Level 1", "solution": f"\\boxed{{{answer}}}"}, indent=2)
        )
    with pytest.raises(DatasetFormatError, match="pass the split"):
        load_prompt_dataset(tmp_path / "MATH")
    assert list(load_prompt_dataset(tmp_path / "MATH", split="test")["answer"]) == ["2"]

    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"question": "q", "answer": 3}, {"question": "r", "answer": 4}]}))
    assert list(load_prompt_dataset(wrapped)["answer"]) == ["3", "4"]

    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "test": datasets.Dataset.from_dict({"problem": ["a"], "answer": ["5"]}),
        "validation": datasets.Dataset.from_dict({"problem": ["b"], "answer": ["6"]}),
    }).save_to_disk(str(saved))
    assert list(load_prompt_dataset(saved, split="validation")["answer"]) == ["6"]
    with pytest.raises(DatasetFormatError, match="has splits"):
        load_prompt_dataset(saved)
    with pytest.raises(DatasetFormatError, match="no split 'dev'"):
        load_prompt_dataset(saved, split="dev")
