"""Public evaluation-file schemas load with the right golds: an oracle that boxes the true answer scores 1.0
on each through the project's grader, a wrong answer scores 0, and multiple-choice sets are refused.

Each schema names its public source. Files in tests/fixtures/eval_schemas/ are look-alikes of those files
(same columns, types and layout, 2-3 rows); the binary formats (parquet, save_to_disk) are built here from
rows of the same shape.
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from poise_trl.tasks import load_prompt_dataset
from poise_trl.tasks.math_grader import is_correct
from poise_trl.tasks.prompts import DatasetFormatError

FIXTURES = Path(__file__).parent / "fixtures" / "eval_schemas"
BOXED = "Please output the final answer within \\boxed{}."


def verl_gsm8k(tmp_path: Path) -> Path:
    """verl examples/data_preprocess/gsm8k.py: chat-list prompt, answer in reward_model.ground_truth, and
    extra_info.answer holding the whole worked solution (which must not be taken for the gold)."""
    rows = [
        {"data_source": "openai/gsm8k",
         "prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. "
                     "How many clips did she sell altogether? Let's think step by step and output the final "
                     "answer after \"####\"."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
         "extra_info": {"split": "test", "index": 0, "answer": "48/2 = 24\n48+24 = 72\n#### 72",
                        "question": "Natalia sold 48 clips ..."}},
        {"data_source": "openai/gsm8k",
         "prompt": [{"role": "user", "content": "Weng earns $12 an hour. How much did she earn for 50 minutes?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "10"},
         "extra_info": {"split": "test", "index": 1, "answer": "12/60 = 0.2\n0.2*50 = 10\n#### 10",
                        "question": "Weng earns ..."}},
    ]
    path = tmp_path / "test.parquet"
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def verl_math(tmp_path: Path) -> Path:
    """verl examples/data_preprocess/math_dataset.py: system + user chat, boxed-extracted ground truth."""
    rows = [
        {"data_source": "DigitalLearningGmbH/MATH-lighteval",
         "prompt": [{"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": "Solve $2x = 1$. " + BOXED}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
         "extra_info": {"split": "test", "index": 0}},
        {"data_source": "DigitalLearningGmbH/MATH-lighteval",
         "prompt": [{"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": "Find the roots of $x^2=4$. " + BOXED}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "-2, 2"},
         "extra_info": {"split": "test", "index": 1}},
    ]
    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def matharena(tmp_path: Path) -> Path:
    """MathArena's hub sets (MathArena/aime_2025, hmmt_feb_2025): problem_idx, problem, answer (text), a
    list of problem types; fetched as parquet shards named like hub files."""
    rows = [
        {"problem_idx": 1, "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ divides $97_b$.",
         "answer": "70", "problem_type": ["Number Theory"]},
        {"problem_idx": 2, "problem": "Compute $\\frac{3}{4}+\\frac{1}{4}$ as a fraction in lowest terms, "
         "then add $\\frac{1}{3}$.", "answer": "\\frac{4}{3}", "problem_type": ["Algebra"]},
    ]
    folder = tmp_path / "matharena"
    folder.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(folder / "train-00000-of-00001.parquet")
    return folder


def saved_amc23(tmp_path: Path) -> Path:
    """`datasets.save_to_disk` of math-ai/amc23 (DatasetDict with a test split: question, answer float)."""
    rows = {"id": [0, 1], "question": ["How many miles from City $A$ will they meet?", "Compute $7 \\cdot 8$."],
            "answer": [27.0, 56.0]}
    folder = tmp_path / "amc23_saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(folder))
    return folder


def numina(tmp_path: Path) -> Path:
    """AI-MO/NuminaMath-CoT: source, problem, solution with \\boxed{}, messages (a chat that is not the prompt)."""
    rows = [
        {"source": "synthetic_math", "problem": "What is $15\\%$ of $80$?",
         "solution": "$0.15 \\cdot 80 = \\boxed{12}$.",
         "messages": [{"role": "user", "content": "What is 15% of 80?"}, {"role": "assistant", "content": "12"}]},
        {"source": "olympiads", "problem": "Find $x$ if $3x+1=10$.", "solution": "So $x=\\boxed{3}$.",
         "messages": [{"role": "user", "content": "Find x."}, {"role": "assistant", "content": "3"}]},
    ]
    path = tmp_path / "numina.parquet"
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


# name: (public source, where the file comes from, load kwargs, true answers, a fragment of the first prompt)
SCHEMAS = {
    "gsm8k": ("openai/grade-school-math grade_school_math/data/test.jsonl (`#### 18`, `#### 2,434`)",
              FIXTURES / "gsm8k.jsonl", {}, ["18", "2434"], "Janet's ducks"),
    "hendrycks-math": ("hendrycks/math MATH/test/<subject>/<n>.json: one JSON object per file, answer in the "
                       "solution's \\boxed{}", FIXTURES / "hendrycks_math", {"split": "test"},
                       ["9", "\\frac{1}{2}", "4\\pi"], "If $x + 2 = 5$"),
    "math-500": ("HuggingFaceH4/MATH-500 test.jsonl", FIXTURES / "math500.jsonl", {},
                 ["(3, \\frac{\\pi}{2})", "\\sqrt{53}"], "Convert the point"),
    "olympiadbench": ("QwenLM/Qwen2.5-Math evaluation/data/olympiadbench/test.json: JSON array, final_answer "
                      "lists, context before the question", FIXTURES / "olympiadbench.json", {},
                      ["2", "2, 3", "2"], "How many moves"),
    "deepscaler": ("agentica-project/rllm (DeepScaleR) test sets: JSON array of {problem, answer, ...}",
                   FIXTURES / "deepscaler_aime.json", {}, ["24", "20"], "Find the remainder"),
    "svamp": ("QwenLM/Qwen2.5-Math evaluation/data/svamp: capitalised Body + Question, float Answer",
              FIXTURES / "svamp.jsonl", {}, ["145", "8"], "There are 87 oranges"),
    "asdiv": ("QwenLM/Qwen2.5-Math evaluation/data/asdiv: body + question, `9 (apples)`",
              FIXTURES / "asdiv.jsonl", {}, ["9", "3"], "Seven red apples"),
    "mawps": ("QwenLM/Qwen2.5-Math evaluation/data/mawps: input / target", FIXTURES / "mawps.jsonl", {},
              ["43", "12"], "Joan found"),
    "minerva-math": ("QwenLM/Qwen2.5-Math evaluation/data/minerva_math: answer only in the solution, with a unit",
                     FIXTURES / "minerva_math.jsonl", {}, ["1.6", "10"], "Find the diameter"),
    "carp-en": ("QwenLM/Qwen2.5-Math evaluation/data/carp_en: the problem in `content`",
                FIXTURES / "carp_en.jsonl", {}, ["b^2 - 9a^2", "8"], "Calculate"),
    "college-math": ("QwenLM/Qwen2.5-Math evaluation/data/college_math: answers in `$...$`",
                     FIXTURES / "college_math.jsonl", {}, ["10-4n", "1"], "Simplify"),
    "amc23-qwen": ("QwenLM/Qwen2.5-Math evaluation/data/amc23: both problem and question, float answers",
                   FIXTURES / "amc23_qwen.jsonl", {}, ["27", "55"], "Cities $A$ and $B$"),
    "gaokao-cloze": ("QwenLM/Qwen2.5-Math evaluation/data/gaokao_math_cloze: null passage/options/label",
                     FIXTURES / "gaokao_math_cloze.jsonl", {}, ["5", "3"], "已知"),
    "aime-csv": ("di-zhang-fdu/AIME_1983_2024 as CSV: ID, Year, Problem Number, Question, Answer, Part",
                 FIXTURES / "aime_1983_2024.csv", {}, ["60", "15", "73"], "Let $x$, $y$ and $z$"),
    "verl-gsm8k": ("volcengine/verl examples/data_preprocess/gsm8k.py parquet", verl_gsm8k, {}, ["72", "10"],
                   "Natalia sold 48 clips"),
    "verl-math": ("volcengine/verl examples/data_preprocess/math_dataset.py parquet", verl_math, {},
                  ["\\frac{1}{2}", "\\{-2, 2\\}"], "Solve $2x = 1$"),
    "matharena": ("MathArena hub sets (problem_idx, problem, answer, problem_type), parquet shards",
                  matharena, {}, ["70", "\\frac{4}{3}"], "integer bases"),
    "save-to-disk": ("datasets.save_to_disk of math-ai/amc23 (question, answer float), split test",
                     saved_amc23, {"split": "test"}, ["27", "56"], "How many miles"),
    "numina": ("AI-MO/NuminaMath-CoT (problem, solution with \\boxed{}, messages)", numina, {}, ["12", "3"],
               "15\\%"),
}


def _source(spec, tmp_path: Path) -> Path:
    where = spec[1]
    return where if isinstance(where, Path) else where(tmp_path)


@pytest.mark.parametrize("name", SCHEMAS)
def test_oracle_scores_one_on_every_public_schema(name, tmp_path, caplog):
    _, _, kwargs, truths, fragment = SCHEMAS[name]
    ds = load_prompt_dataset(_source(SCHEMAS[name], tmp_path), prompt_suffix=BOXED, **kwargs)
    assert len(ds) == len(truths), list(ds["answer"])
    assert fragment in ds[0]["prompt"][-1]["content"]
    oracle = [is_correct(f"\\boxed{{{truth}}}", gold) for truth, gold in zip(truths, ds["answer"], strict=True)]
    assert sum(oracle) / len(oracle) == 1.0, list(zip(truths, ds["answer"], strict=True))
    assert not any(is_correct("\\boxed{123457}", gold) for gold in ds["answer"])  # golds are not vacuous
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # every row of these files is usable


def test_at_least_fifteen_public_schemas():
    assert len(SCHEMAS) >= 15
    assert all(source for source, *_ in SCHEMAS.values())


def test_context_and_question_are_joined():
    svamp = load_prompt_dataset(FIXTURES / "svamp.jsonl")
    text = svamp[0]["prompt"][0]["content"]
    assert text.startswith("There are 87 oranges") and text.endswith("How big is each group of bananas?")
    olympiad = load_prompt_dataset(FIXTURES / "olympiadbench.json")
    assert olympiad[1]["prompt"][0]["content"] == "Let $f(x)=x^2-5x+6$.\nFind all real roots of $f$."
    explicit = load_prompt_dataset(FIXTURES / "svamp.jsonl", columns={"question": "question", "answer": "equation"})
    assert explicit[0]["prompt"][0]["content"] == "How big is each group of bananas?"


def test_chat_prompts_and_nested_answers(tmp_path):
    ds = load_prompt_dataset(verl_gsm8k(tmp_path), prompt_suffix=BOXED, system_prompt="ignored for chats")
    assert ds[0]["prompt"][0]["role"] == "user" and len(ds[0]["prompt"]) == 1
    assert list(ds["answer"]) == ["72", "10"]  # reward_model.ground_truth, not extra_info.answer
    assert "data_source" in ds.column_names and "reward_model" not in ds.column_names
    # the same gold through an explicit dotted path, in any case
    explicit = load_prompt_dataset(verl_gsm8k(tmp_path), columns={"answer": "Extra_Info.Answer"})
    assert list(explicit["answer"]) == ["72", "10"]


def test_metadata_columns_survive(tmp_path):
    ds = load_prompt_dataset(FIXTURES / "math500.jsonl")
    assert list(ds["level"]) == [2, 4] and list(ds["subject"]) == ["Precalculus", "Prealgebra"]
    csv = load_prompt_dataset(FIXTURES / "aime_1983_2024.csv")
    assert list(csv["Year"]) == [1983, 1983, 2024]


@pytest.mark.parametrize(
    "file, why",
    [("mc_aqua.jsonl", "column 'options'"), ("mc_mmlu_stem.jsonl", "column 'choices'"),
     ("mc_sat_math.jsonl", "column 'options'"), ("mc_gaokao2024.jsonl", "answers are option letters")],
)
def test_multiple_choice_sets_are_refused_in_one_line(file, why):
    """AQuA, MMLU-STEM, SAT math and Gaokao 2024 choice questions, as Qwen2.5-Math's evaluation/data ships them."""
    with pytest.raises(DatasetFormatError) as error:
        load_prompt_dataset(FIXTURES / file, column_option="--{role}-column COLUMN")
    message = str(error.value)
    assert "multiple-choice sets are not supported" in message and why in message
    assert "\n" not in message and "--answer-column COLUMN" in message


def test_undetected_column_names_the_flag_of_the_command(tmp_path):
    """`poise bench` on a file whose answer column is not detected: the hint names --answer-column (the data
    is refused before any model is loaded)."""
    from helpers import assert_one_line_error

    from poise_trl.cli.main import app

    path = tmp_path / "odd.jsonl"
    path.write_text('{"question": "What is 1+1?", "result": "2"}\n')
    result = CliRunner().invoke(app, ["bench", str(path), "--model", "data/tiny-qwen3", "-o", str(tmp_path / "out")])
    assert_one_line_error(result, result.output, "--answer-column COLUMN")
    with pytest.raises(DatasetFormatError, match="dataset_columns"):
        load_prompt_dataset(path)  # recipes and Python callers get the recipe key
