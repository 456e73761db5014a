"""What a new user meets in the first hour (docs/getting-started.md): bench's samples carry each row's id and
its token budget fits the model's context; a reward module in the working directory is found; the page's
table of the scores bench's files hold matches the files bench writes."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from poise_trl.core.loading import load_tokenizer
from poise_trl.engines import generation
from poise_trl.engines.generation import Sample, TransformersEngine
from poise_trl.evaluation import bench, bench_reports, bench_scores
from poise_trl.evaluation.bench_data import DataRequest
from poise_trl.tasks import task_rows
from poise_trl.tasks.rewards import get_reward_functions

GETTING_STARTED = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"


@pytest.fixture
def fake_sampler(monkeypatch):
    """Transformers' engine (not vLLM's) whose samples are canned; records each call's max_new_tokens."""
    monkeypatch.setattr(generation, "vllm_import_error", lambda: "vLLM is switched off in these tests")
    budgets = []

    def sample(engine, prompts, num_samples, on_batch, prompt_indices, max_new_tokens, **kwargs):
        budgets.append(max_new_tokens)
        batch = [Sample(prompt_indices[0], "<answer>4</answer>", 3, False) for _ in range(num_samples)]
        on_batch(batch)
        return batch

    monkeypatch.setattr(TransformersEngine, "sample", sample)
    return budgets


def test_bench_samples_carry_the_row_id_and_the_budget_is_capped_at_the_context_once(
        tmp_path, tiny_random_model_dir, fake_sampler, caplog):
    task = "reasoning-gym:leg_counting"
    common = dict(num_samples=2, temperature=1.0, top_p=1.0, show_progress=False,
                  request=DataRequest(limit=3), engine="transformers")
    with caplog.at_level(logging.WARNING, logger="poise_trl.evaluation.bench"):
        summary = bench.run_benchmarks([task], str(tiny_random_model_dir), max_new_tokens=5000,
                                       output_dir=tmp_path, **common)
    settings = summary["benchmarks"]["reasoning-gym-leg_counting"]["settings"]
    capped = [record.getMessage() for record in caplog.records if "capped" in record.getMessage()]
    assert len(capped) == 1, capped
    found = re.search(r"capped at (\d+): the model's context is (\d+) tokens and the longest prompt "
                      r"takes (\d+)", capped[0])
    room, context, longest = map(int, found.groups())
    rows = task_rows(task, "test", 3, 0)
    tokenizer = load_tokenizer(str(tiny_random_model_dir))
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
             for row in rows]
    assert longest == max(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    assert (context, room) == (1024, 1024 - longest)
    assert settings["max_new_tokens"] == room and set(fake_sampler) == {room}

    samples = tmp_path / "reasoning-gym-leg_counting" / "samples.jsonl"
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(row["id"] for row in rows for _ in range(2))
    assert all(r["id"] == rows[r["problem"]]["id"] for r in records)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poise_trl.evaluation.bench"):
        bench.run_benchmarks([task], str(tiny_random_model_dir), max_new_tokens=8,
                             output_dir=tmp_path / "short", **common)
    assert not [r for r in caplog.records if "capped" in r.getMessage()] and fake_sampler[-1] == 8


def test_a_reward_module_in_the_working_directory_is_found_without_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "first_hour_rewards.py").write_text("def shout(completions, **kwargs):\n"
                                                    "    return [1.0 for _ in completions]\n")
    (tmp_path / "first_hour_broken.py").write_text("import no_such_package_anywhere\n")
    monkeypatch.chdir(tmp_path)
    # The console script's path: its own folder first, not the working directory (`python -m` would add it).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("first_hour_rewards", "first_hour_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    [function] = get_reward_functions(["first_hour_rewards:shout"])
    assert function(["a", "b"]) == [1.0, 1.0]
    # A module that is there but fails to import says so, not that it was not found.
    with pytest.raises(ValueError, match="No module named 'no_such_package_anywhere'"):
        get_reward_functions(["first_hour_broken:anything"])
    with pytest.raises(ValueError, match="cannot import 'nowhere_at_all'"):
        get_reward_functions(["nowhere_at_all:shout"])


def documented_scores() -> dict[str, dict[str, str]]:
    """The table of docs/getting-started.md's section on bench's files: first cell -> {score: cell}."""
    section = GETTING_STARTED.read_text().split("## Which scores bench's files hold", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    header, *body = rows
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in body}


def scored(dataset, n: int = 2) -> dict:
    """bench's metrics for `dataset` with n made-up graded samples per problem."""
    records = {(p, s): {"sample": s, "correct": s == 0, "reward": float(s == 0), "answer": "1",
                        "num_tokens": 5, "truncated": False} for p in range(len(dataset)) for s in range(n)}
    return bench_scores.dataset_metrics(records, dataset, n)


def lighteval_metrics(benchmarks: dict) -> dict[str, set[str]]:
    """The metric names results_lighteval.json gives each benchmark (and `all`), as bench writes the file."""
    settings = {"num_samples": 2, "data_source": "x", "split": None, "max_new_tokens": 8, "temperature": 1.0,
                "top_p": 1.0, "seed": 0}
    summary = {"model": "m", "benchmarks": {name: {"settings": settings, "metrics": m}
                                            for name, m in benchmarks.items()},
               "average": bench_scores.average_over_benchmarks(list(benchmarks.values()))}
    results = bench_reports.lighteval_results(summary)["results"]
    return {key.removesuffix("|0"): {name.split(":")[0] for name in metrics if not name.endswith("_stderr")}
            for key, metrics in results.items()}


def test_the_docs_table_of_scores_matches_the_files_bench_writes():
    math = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}] * 2)
    kinds = {"math": math}
    for name in ("reasoning-gym:leg_counting", "humaneval", "bfcl", "ifeval"):
        kinds[name] = datasets.Dataset.from_list(task_rows(name, "test", 2, 0))
    table = documented_scores()
    found = lighteval_metrics({name: scored(dataset) for name, dataset in kinds.items()})
    for row, cells in table.items():
        kind = next((k for k in kinds if k.split(":")[0] in row), None)
        if kind is None:
            assert row.startswith("`all`"), row
            continue
        for score, cell in cells.items():
            assert (score in found[kind]) == (cell == "yes"), (row, score, cell, found[kind])
    all_row = table[next(row for row in table if row.startswith("`all`"))]
    assert all_row["maj@n"] == "when every benchmark has it"
    assert "maj@n" not in found["all"]  # humaneval is among them
    voting = lighteval_metrics({"math": scored(math), "rg": scored(kinds["reasoning-gym:leg_counting"])})
    assert "maj@n" in voting["all"] and {"avg@n", "pass@k"} <= voting["all"] & found["all"]


def test_math_task_rows_keep_the_sources_own_id(monkeypatch):
    """`math:math-500` rows carry MATH-500's `unique_id`, so a file of MATH-500 answers grades by it; a
    source without ids numbers its rows."""
    from poise_trl.tasks import math_sets

    def ids_of(row: dict) -> list[str]:
        monkeypatch.setattr(math_sets, "load_math_dataset", lambda *a, **k: datasets.Dataset.from_list([row]))
        return [built["id"] for built in math_sets.build_rows("math-500", {}, "test", None, 0)]

    row = {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}
    assert ids_of({**row, "unique_id": "test/algebra/7.json"}) == ["test/algebra/7.json"]
    assert ids_of(row) == ["math-500/test/0"]


# --- The first hour of issue 51: refusals before the libraries load, names looked up locally first, a run
# that did not learn says so ---

def test_every_bad_gpus_value_is_refused_in_one_line_before_torch_loads(tmp_path):
    from poise_trl.cli.main import app

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "gpu" / "poise_qwen3-4b.yaml"
    # each refusal in a fresh interpreter that reports, as it exits, whether torch or TRL were ever imported
    probe = ("import atexit, sys; atexit.register(lambda: print('loaded:', sorted({'torch', 'trl'} & "
             "set(sys.modules)), file=sys.stderr)); sys.argv[0] = 'poise'; from poise_trl.cli.main import app; app()")
    for args in (["--gpus", "0"], ["--gpus", "-1"], ["--gpus", "two"], ["gpus=0"], ["gpus=-2"]):
        run = subprocess.run([sys.executable, "-c", probe, "plan", str(recipe), *args], capture_output=True,
                             text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(recipe.parents[2])})
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == 2 and len(errors) == 1 and "gpus" in errors[0], (args, run.stderr)
        assert "loaded: []" in run.stderr, (args, run.stderr[-2000:])
    from typer.testing import CliRunner

    missing = CliRunner().invoke(app, ["train", str(tmp_path / "nowhere.yaml")])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_dataset_and_model_typos_get_did_you_mean_without_hf_hub_offline(monkeypatch):
    from huggingface_hub import constants

    from poise_trl.run import build
    from poise_trl.tasks import TaskError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    from poise_trl.core import loading

    monkeypatch.setattr(loading, "hub_unreachable", lambda: pytest.fail("the hub was asked about a local typo"))
    with pytest.raises(TaskError, match="did you mean 'toy-arith'"):
        build.hub_or_offline("toy-arithh", None)
    with pytest.raises(loading.RecipeError, match="did you mean the bundled 'data/tiny-qwen3'"):
        loading.load_tokenizer("data/tiny-qwen")


@pytest.mark.slow
def test_a_run_whose_probe_never_fitted_and_whose_reward_stayed_0_says_so(tmp_path, tiny_random_model_dir):
    from poise_trl.run.train import train_from_recipe

    recipe = {"algo": "poise", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 16,
              "eval_limit": 4, "eval_every": 0, "eval_num_samples": 1, "eval_max_new_tokens": 8,
              "per_device_train_batch_size": 4, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
              "save_steps": 2, "seed": 0, "probe_bootstrap_steps": 4, "rewards": ["math_accuracy"]}
    lines = []
    train_from_recipe(recipe, str(tmp_path / "run"), show_progress=False, log=lines.append)
    assert [line for line in lines if line.startswith("note: POISE's probe gave no baseline")], lines
    assert [line for line in lines if line.startswith("note: the training reward was 0 at every logged step (2)")]


def test_probe_eval_tables_fit_80_columns_and_say_what_n_a_means(monkeypatch):
    """The committed toy report, as `poise probe-eval` prints it on an 80-column terminal: no cell cut or wrapped,
    an all-n/a column left out with its reason, and what n/a means."""
    from rich.console import Console

    from poise_trl.cli import probe_eval

    report = json.loads((GETTING_STARTED.parents[1] / "benchmarks" / "results" / "probe_eval_toy" /
                         "report.json").read_text())
    console = Console(width=80, record=True, force_terminal=False)
    monkeypatch.setattr(probe_eval, "console", console)
    probe_eval._print_report(report, Path("out"))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    rows = {line.split("  ")[0]: line for line in text.splitlines() if line.startswith(("POISE probe", "train mean"))}
    assert rows["train mean"].split() == ["train", "mean", "0.204", "n/a", "n/a-n/a", "n/a", "0.500", "0.242", "0.029"]
    assert "n/a: the metric is undefined there" in text and "AUROC solved (prompts solved at least once" in text


def test_shipped_recipes_load_by_name_or_repository_path_from_any_folder(tmp_path, monkeypatch):
    from poise_trl.run.recipe import RecipeError, bundled_recipes, load_recipe, read_yaml

    shipped = (GETTING_STARTED.parents[1] / "recipes" / "toy" / "poise.yaml").read_text()
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the package's own copies are found
    assert load_recipe("poise") == load_recipe("toy/poise") == load_recipe("recipes/toy/poise.yaml") == \
        read_yaml(shipped)
    assert {"toy/poise", "gpu/poise_qwen3-4b", "accelerate/zero3"} <= set(bundled_recipes())
    with pytest.raises(RecipeError, match="did you mean 'poise'"):
        load_recipe("poisee")


@pytest.mark.parametrize("line", ["num_processes: 0", "num_processes: -1", "num_machines: 0", "num_processes: two"])
def test_a_bad_process_or_machine_count_in_an_accelerate_config_is_refused(tmp_path, line):
    from typer.testing import CliRunner

    from poise_trl.cli.main import app

    config = tmp_path / "launch.yaml"
    config.write_text(f"distributed_type: MULTI_GPU\n{line}\n")
    recipe = GETTING_STARTED.parents[1] / "recipes" / "gpu" / "poise_qwen3-4b.yaml"
    result = CliRunner().invoke(app, ["plan", str(recipe), "--accelerate-config", str(config)])
    errors = [text for text in result.output.splitlines() if text.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and f"{line.split(':')[0]}: " in errors[0], result.output
