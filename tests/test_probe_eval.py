"""`poise probe-eval`: metrics against hand-computed values, the prompt-level split, the rollout/feature/
value-model cache, and one-line CLI errors. Pipeline runs use the untrained 2-layer model with 2 short
rollouts per prompt; grading is replaced by a deterministic coin so that rewards vary."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
import typer
from helpers import assert_one_line_error
from typer.testing import CliRunner

from poise_trl import metrics
from poise_trl import probe_eval as pe
from poise_trl.cli.probe_eval import probe_eval as probe_eval_command
from poise_trl.generation import TransformersEngine

QUESTIONS = [f"What is {a} plus {b}?" for a, b in ((3, 4), (12, 30), (5, 9), (7, 7), (21, 8), (6, 1), (40, 2), (9, 9))]


@pytest.fixture
def toy_file(tmp_path) -> Path:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture
def sampler_calls(monkeypatch) -> list[dict]:
    """Count calls of the transformers sampler and grade by a hash of the text (the untrained model is
    never right), so rewards vary and every metric is defined."""
    calls: list[dict] = []
    real = TransformersEngine.sample

    def counting(engine, *args, **kwargs):
        calls.append(kwargs)
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(TransformersEngine, "sample", counting)
    monkeypatch.setattr(pe, "is_correct", lambda text, gold: zlib.crc32(text.encode()) % 2 == 0)
    return calls


def settings(model, data, out, **kwargs) -> pe.ProbeEvalSettings:
    # transformers: vLLM's CPU build has no attention kernel for the tiny test model's 8-wide heads
    # (tests/test_vllm.py runs probe-eval through vLLM on the bundled model).
    base = dict(n_samples=2, max_new_tokens=6, value_epochs=1, value_batch_size=4, batch_size=8, engine="transformers")
    return pe.ProbeEvalSettings(model=str(model), dataset=str(data), output_dir=str(out), **(base | kwargs))


# ------------------------------------------------------------------------------------------- metrics


def test_metrics_match_hand_computed_values():
    pred, target = torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.5, 0.25, 1.0])
    # errors 0.1, -0.1, 0.1, -0.2; Var(target) = 0.546875 / 4 (population)
    assert metrics.mae(pred, target) == pytest.approx(0.125)
    assert metrics.rmse(pred, target) == pytest.approx(math.sqrt(0.0175))
    assert metrics.brier_skill(pred, target) == pytest.approx(1 - 0.0175 / 0.13671875)  # 0.872
    m = metrics.value_metrics(pred, target)
    assert m["pearson"] == pytest.approx(0.365625 / math.sqrt(0.251875 * 0.546875))
    assert m["spearman"] == pytest.approx(1.0)  # same order
    assert m["auroc_solved"] == pytest.approx(1.0)  # the only unsolved prompt has the lowest prediction

    # ties: ranks share their average; AUROC counts a tied positive/negative pair as 1/2
    assert metrics.ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    pred, target = torch.tensor([0.2, 0.2, 0.5, 0.9]), torch.tensor([0.0, 0.5, 0.5, 1.0])
    assert metrics.spearman(pred, target) == pytest.approx(3.75 / 4.5)  # ranks [1.5,1.5,3,4] vs [1,2.5,2.5,4]
    assert metrics.auroc(pred, target > 0) == pytest.approx(2.5 / 3)  # positives 0.2 (tie), 0.5, 0.9 vs 0.2

    lo, hi = metrics.pearson_ci95(0.5, 28)  # Fisher z: atanh(0.5) -+ 1.96 / sqrt(25)
    assert (lo, hi) == pytest.approx((math.tanh(math.atanh(0.5) - 0.392), math.tanh(math.atanh(0.5) + 0.392)))

    # undefined, not an exception: constant target, one class, too few pairs
    const = torch.full((4,), 0.5)
    assert math.isnan(metrics.brier_skill(pred, const)) and math.isnan(metrics.value_metrics(pred, const)["pearson"])
    assert math.isnan(metrics.auroc(pred, torch.ones(4, dtype=torch.bool)))
    assert all(math.isnan(x) for x in metrics.pearson_ci95(0.9, 3))


def test_paired_bootstrap_interval_contains_the_difference():
    target = torch.linspace(0, 1, 30)
    good, bad = target + 0.05 * torch.sin(torch.arange(30.0)), target.flip(0)
    diff = metrics.paired_bootstrap(good, bad, target, n_boot=200)
    assert diff["pearson"]["diff"] == pytest.approx(metrics.pearson(good.double(), target.double()) + 1.0)
    lo, hi = diff["mae"]["ci95"]
    assert lo <= diff["mae"]["diff"] <= hi < 0


# --------------------------------------------------------------------------------------------- split


def test_split_is_by_prompt_and_seeded():
    train, heldout = pe.split_prompts(10, 0.3, seed=0)
    assert len(heldout) == 3 and sorted(train + heldout) == list(range(10)) and not set(train) & set(heldout)
    assert pe.split_prompts(10, 0.3, seed=0) == (train, heldout)
    assert any(pe.split_prompts(10, 0.3, seed=s)[1] != heldout for s in range(1, 5))
    # rows are prompt-major: prompt i owns rows i*n .. i*n+n-1, so a prompt's rollouts never straddle the split
    assert pe.rollout_rows([1, 3], 2).tolist() == [2, 3, 6, 7]
    rows_train, rows_heldout = set(pe.rollout_rows(train, 4).tolist()), set(pe.rollout_rows(heldout, 4).tolist())
    assert not rows_train & rows_heldout and len(rows_train | rows_heldout) == 40
    with pytest.raises(pe.ProbeEvalError, match="at least 2"):
        pe.split_prompts(4, 0.2, seed=0)


def test_probe_dims_keep_the_spec_at_the_reference_buffer_and_shrink_below():
    assert pe.probe_dims(32, 64, train_prompts=2048, train_rows=4096) == (32, 64)  # poise-spec's buffer
    assert pe.probe_dims(32, 64, train_prompts=140, train_rows=1120) == (2, 17)  # toy-arith, 8 rollouts
    assert pe.probe_dims(32, 64, train_prompts=6, train_rows=12) == (1, 1)
    assert pe.probe_dims(8, 16, train_prompts=10_000, train_rows=80_000) == (8, 16)  # never above the request


def test_layers_parse_and_default_sweep():
    assert pe.parse_layers(["0,2", " 0.55", ""]) == [0, 2, 0.55]
    assert pe.default_sweep(4) == [0, 1, 2, 3] and 0.55 in pe.default_sweep(36)
    with pytest.raises(pe.ProbeEvalError, match="'x'"):
        pe.parse_layers(["1,x"])


# ------------------------------------------------------------------------------------ pipeline + cache


def test_pipeline_report_and_cache(tmp_path, toy_file, tiny_random_model_dir, sampler_calls):
    out = tmp_path / "out"
    report = pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0]), show_progress=False)
    assert len(sampler_calls) == 1 and report["cache"]["rollouts"] == "sampled"
    assert report["cache"]["feature_blocks_computed"] == [0, 1]  # main block 0.55 -> 1, sweep block 0
    assert set(report["estimators"]) == {"constant", "probe", "probe_prompt_only", "probe_no_entropy", "value_model"}
    assert (out / "report.json").is_file() and all(Path(p).is_file() for p in report["plots"].values())

    # The split in the report is by prompt, and the numbers agree with the cached rollouts.
    train, heldout = report["split"]["train"], report["split"]["heldout"]
    assert not set(train) & set(heldout) and sorted(train + heldout) == list(range(len(QUESTIONS)))
    groups = [json.loads(line) for line in (Path(report["cache"]["dir"]) / "rollouts.jsonl").read_text().splitlines()]
    assert all(len(g["rollouts"]) == 2 and g["prompt_ids"] for g in groups)
    train_mean = sum(r["reward"] for i in train for r in groups[i]["rollouts"]) / (2 * len(train))
    empirical = [sum(r["reward"] for r in groups[i]["rollouts"]) / 2 for i in heldout]
    constant = report["estimators"]["constant"]["prompt_level"]
    assert constant["mae"] == pytest.approx(sum(abs(train_mean - e) for e in empirical) / len(empirical))

    # Same settings: nothing is generated, computed or trained again.
    again = pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0]), show_progress=False)
    assert len(sampler_calls) == 1
    assert again["cache"] == report["cache"] | {"rollouts": "reused", "feature_blocks_computed": [], "value_model": "reused"}
    assert again["estimators"] == report["estimators"]

    # A new analysis setting reuses the rollouts.
    pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0], ridge_alpha=10.0), show_progress=False)
    assert len(sampler_calls) == 1

    # A changed sampling setting samples afresh, into its own cache entry.
    changed = pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0], temperature=0.7),
                                show_progress=False)
    assert len(sampler_calls) == 2 and sampler_calls[-1]["temperature"] == 0.7
    assert changed["cache"]["rollouts"] == "sampled" and changed["cache"]["dir"] != report["cache"]["dir"]


# ----------------------------------------------------------------------------------------------- CLI


def cli(*args):
    app = typer.Typer()
    app.command()(probe_eval_command)
    result = CliRunner().invoke(app, [str(a) for a in args] + ["--engine", "transformers"])
    return result, result.output




def test_cli_defaults_are_the_library_defaults():
    import dataclasses
    import inspect

    library = {f.name: f.default for f in dataclasses.fields(pe.ProbeEvalSettings) if f.default is not dataclasses.MISSING}
    for name, param in inspect.signature(probe_eval_command).parameters.items():
        if name in library and name != "layer":
            default = param.default.default
            assert (str(default) if isinstance(default, Path) else default) == library[name], name
    assert float(inspect.signature(probe_eval_command).parameters["layer"].default.default) == library["layer"]


def test_cli_prints_the_table(tmp_path, toy_file, tiny_random_model_dir, sampler_calls):
    result, output = cli("--model", tiny_random_model_dir, "--dataset", toy_file, "-n", 2, "--max-new-tokens", 4,
                         "--value-epochs", 1, "--layers", "0,1", "-o", tmp_path / "out", "--no-progress")
    assert result.exit_code == 0, output
    assert "POISE probe" in output and "value model" in output and "layer sweep" in output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [row["block"] for row in report["layer_sweep"]] == [0, 1]


def test_cli_errors_are_one_line_and_come_before_sampling(tmp_path, tiny_random_model_dir, sampler_calls):
    no_answers = tmp_path / "questions.jsonl"
    no_answers.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS))
    common = ("--model", tiny_random_model_dir, "-o", tmp_path / "out", "--no-progress")
    assert_one_line_error(*cli(*common, "--dataset", no_answers), "no answer column")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "--layers", "0,5"), "layer 5 is out of range")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "--layer", "1.5"), "layer 1.5 is out of range")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "-n", 1), "--n-samples must be >= 2")
    assert_one_line_error(*cli("--dataset", "toy-arith"), "--model")
    assert not sampler_calls
