"""`poise probe-eval`: metrics against hand-computed values, the prompt-level split, the rollout/feature/
value-model cache, task mixes (per-task metrics and the probe's transfer between tasks), and one-line CLI
errors. Pipeline runs use the untrained 2-layer model with 2 short rollouts per prompt; grading is replaced
by a deterministic coin so that rewards vary."""

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

from poise_trl.cli.probe_eval import probe_eval as probe_eval_command
from poise_trl.core import metrics
from poise_trl.core.estimators import leave_one_out_targets
from poise_trl.engines.generation import TransformersEngine
from poise_trl.evaluation import probe_eval as pe
from poise_trl.probe.estimator import LinearValueProbe
from poise_trl.probe.features import RolloutFeatures
from poise_trl.tasks import TaskError, resolve_dataset

CHAIN_SUM, LEG_COUNTING = "reasoning-gym:chain_sum", "reasoning-gym:leg_counting"
SHORT = "config: {system_prompt: direct}"  # reasoning-gym's shortest system prompt: shorter sequences to embed
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
    # Every row is graded through tasks.score_rows (a math row by the math family's verifier).
    monkeypatch.setattr(pe, "score_rows", lambda texts, tasks, verifiers: [float(hash_coin(t)) for t in texts])
    return calls


def hash_coin(text: str) -> bool:
    return zlib.crc32(text.encode()) % 2 == 0


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


def test_correctness_metrics_match_hand_computed_values():
    pred, right = torch.tensor([0.1, 0.15, 0.8, 0.9, 0.7]), torch.tensor([False, True, True, True, False])
    m = metrics.correctness_metrics(pred, right)
    assert m["auroc"] == pytest.approx(5 / 6)  # 0.15 ranks under 0.7; every other right-wrong pair in order
    assert m["brier"] == pytest.approx((0.01 + 0.7225 + 0.04 + 0.01 + 0.49) / 5)
    # bins of width 0.1: {0.1, 0.15} 1 of 2 right (gap 0.375, 2 rows), 0.7 wrong, 0.8 and 0.9 right
    assert m["ece"] == pytest.approx((2 * 0.375 + 0.7 + 0.2 + 0.1) / 5)
    assert m["share_right"] == pytest.approx(0.6)
    # predictions outside [0, 1] are clipped before Brier and ECE (a ridge probe can overshoot)
    assert metrics.correctness_metrics(torch.tensor([1.3, -0.2]), torch.tensor([True, False])) == {
        "auroc": 1.0, "brier": 0.0, "ece": 0.0, "share_right": 0.5}


def test_auroc_difference_resolves_a_better_predictor_and_not_a_tie():
    n, generator = 4, torch.Generator().manual_seed(0)
    rewards = (torch.rand(40 * n, generator=generator) < 0.4).float()
    noise = torch.rand(40 * n, generator=generator)
    better = pe.auroc_difference(rewards + 0.5 * noise, noise, rewards, n, n_boot=300)
    assert better["diff"] > 0.3 and better["ci95"][0] > 0
    tie = pe.auroc_difference(noise, torch.rand(40 * n, generator=generator), rewards, n, n_boot=300)
    assert tie["ci95"][0] < 0 < tie["ci95"][1]


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


def test_a_mix_splits_each_task_on_its_own():
    tasks = ["a", "b"] * 6 + ["a"] * 8 + ["c"]  # a: 14 prompts, b: 6, c: 1
    train, heldout = pe.split_prompts(len(tasks), 0.3, seed=3, tasks=tasks)
    assert sorted(train + heldout) == list(range(len(tasks))) and not set(train) & set(heldout)
    assert [sum(tasks[p] == t for p in heldout) for t in "abc"] == [4, 2, 0]  # round(0.3 x prompts) of each
    # One task alone splits exactly as untagged prompts do: reports on one task keep their split.
    assert pe.split_prompts(10, 0.3, seed=3, tasks=["a"] * 10) == pe.split_prompts(10, 0.3, seed=3)


def test_dataset_option_reads_task_mixes(tmp_path):
    assert resolve_dataset(f"{CHAIN_SUM}+{LEG_COUNTING}") == [CHAIN_SUM, LEG_COUNTING]
    assert resolve_dataset("toy-arith") == "toy-arith" and resolve_dataset(CHAIN_SUM) == CHAIN_SUM
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"dataset:\n  - {CHAIN_SUM}\n  - {{name: {LEG_COUNTING}, weight: 3}}\n")
    assert resolve_dataset(str(mix)) == [CHAIN_SUM, {"name": LEG_COUNTING, "weight": 3}]
    plus_file = tmp_path / "a+b.jsonl"  # a file whose name holds a '+' is a file
    plus_file.write_text("")
    assert resolve_dataset(str(plus_file)) == str(plus_file)

    (tmp_path / "no_list.yaml").write_text(f"dataset: {CHAIN_SUM}\n")
    with pytest.raises(TaskError, match="no `dataset:` list"):
        resolve_dataset(str(tmp_path / "no_list.yaml"))
    with pytest.raises(TaskError, match="no such mix file"):
        resolve_dataset(str(tmp_path / "missing.yml"))
    with pytest.raises(TaskError, match="empty task name"):
        resolve_dataset(f"{CHAIN_SUM}+")
    with pytest.raises(pe.ProbeEvalError, match="give --limit"):  # weights share --limit; without it, ignored
        pe.check_mix_size(resolve_dataset(str(mix)), limit=None)
    pe.check_mix_size(resolve_dataset(str(mix)), limit=8)
    pe.check_mix_size([CHAIN_SUM, LEG_COUNTING], limit=None)  # equal weights: each task's own default count
    with pytest.raises(TaskError, match="did you mean 'reasoning-gym'"):
        pe.check_mix_size(["reasoning-gymm:chain_sum", {"name": CHAIN_SUM, "weight": 2}], limit=None)


def synthetic_mix(n: int = 4) -> tuple[RolloutFeatures, torch.Tensor, list[str]]:
    """Two tasks whose value is read off the same prompt direction with opposite signs ("up": v = x,
    "down": v = 1 - x), and a one-prompt task; k of a prompt's n rollouts succeed, k = round(n v)."""
    generator = torch.Generator().manual_seed(0)
    tasks = ["up", "down"] * 16 + ["tiny"]
    x = torch.rand(len(tasks), generator=generator)
    value = torch.where(torch.tensor([t == "down" for t in tasks]), 1 - x, x)
    successes = (value * n).round().long()
    rewards = (torch.arange(n)[None, :] < successes[:, None]).float().flatten()
    prompt = torch.cat([10 * x[:, None], 0.01 * torch.randn(len(tasks), 3, generator=generator)], 1)
    rows = len(tasks) * n
    features = RolloutFeatures(prompt.repeat_interleave(n, 0), 0.01 * torch.randn(rows, 4, generator=generator),
                               0.01 * torch.rand(rows, 3, generator=generator))
    return features, rewards, tasks


def test_transfer_fits_on_one_task_and_scores_every_task():
    n = 4
    features, rewards, tasks = synthetic_mix(n)
    train, heldout = pe.split_prompts(len(tasks), 0.3, seed=0, tasks=tasks)
    settings = pe.ProbeEvalSettings(model="m", dataset="d", n_samples=n, ridge_alpha=1.0)
    empirical = pe.per_prompt_mean(rewards[pe.rollout_rows(heldout, n)], n)
    pooled_mean = float(rewards[pe.rollout_rows(train, n)].mean())
    # per held-out rollout: the pooled mean, its prompt's Avg@n ("value_model"), its own reward ("probe")
    predictions = {"constant": torch.full((len(heldout) * n,), pooled_mean),
                   "value_model": empirical.repeat_interleave(n),
                   "probe": rewards[pe.rollout_rows(heldout, n)]}
    by_task, transfer = pe.evaluate_by_task(features, rewards, tasks, train, heldout, predictions, empirical, n,
                                            settings)

    assert transfer["tasks"] == ["down", "up"]  # sorted; the one-prompt task is left out
    (down_down, down_up), (up_down, up_up) = transfer["pearson"]
    assert up_up > 0.9 and down_down > 0.9  # within task, the direction is learnt
    assert up_down < -0.9 and down_up < -0.9  # across tasks it points the wrong way: transfer fails
    assert transfer["mae"][1][1] < transfer["mae"][1][0]
    # Rows are the task the probe was fit on: refit on "up" by hand, score on "down"'s held-out prompts.
    up_train = pe.rollout_rows([p for p in train if tasks[p] == "up"], n)
    down_heldout = pe.rollout_rows([p for p in heldout if tasks[p] == "down"], n)
    probe = LinearValueProbe(**pe.probe_settings(settings, 11, n))
    probe.fit(features[up_train], leave_one_out_targets(rewards, n)[up_train])
    assert up_down == pytest.approx(metrics.pearson(pe.per_prompt_mean(probe.predict(features[down_heldout]), n),
                                                    pe.per_prompt_mean(rewards[down_heldout], n)))

    assert by_task["tiny"] == {"train_prompts": 1, "heldout_prompts": 0, "mean_reward": pytest.approx(
        float(rewards[-n:].mean())), "skipped": by_task["tiny"]["skipped"]}
    assert by_task["tiny"]["skipped"].startswith("1 train prompt(s): its own probe needs at least 2")
    up = by_task["up"]
    mine = [p for p in heldout if tasks[p] == "up"]
    assert (up["train_prompts"], up["heldout_prompts"]) == (11, len(mine)) == (11, 5)
    assert set(up["estimators"]) == {"constant", "value_model", "probe", "task_mean", "probe_task_only"}
    assert up["estimators"]["value_model"]["mae"] == 0
    assert up["estimators"]["probe_task_only"]["pearson"] == up_up
    # per rollout: the rollout's own reward is a perfect, calibrated predictor; a constant ranks nothing
    assert up["estimators"]["probe"]["correctness"] | {"share_right": 0} == {"auroc": 1, "brier": 0, "ece": 0,
                                                                             "share_right": 0}
    assert up["estimators"]["constant"]["correctness"]["auroc"] == 0.5
    assert 0.5 < up["estimators"]["value_model"]["correctness"]["auroc"] < 1  # a prompt's rollouts tie
    difference = up["probe_minus_value_model"]["auroc"]
    assert difference["diff"] == pytest.approx(1 - up["estimators"]["value_model"]["correctness"]["auroc"])
    assert transfer["auroc"][1][1] == up["estimators"]["probe_task_only"]["correctness"]["auroc"] > 0.5
    own_mean = float(rewards[pe.rollout_rows([p for p in train if tasks[p] == "up"], n)].mean())
    up_empirical = pe.per_prompt_mean(rewards[pe.rollout_rows(mine, n)], n)
    assert up["estimators"]["task_mean"]["mae"] == pytest.approx(float((up_empirical - own_mean).abs().mean()))
    assert up["estimators"]["constant"]["mae"] == pytest.approx(float((up_empirical - pooled_mean).abs().mean()))
    assert up["heldout_mean_avg_at_n"] == pytest.approx(float(up_empirical.mean()))


def test_probe_dims_keep_the_spec_at_the_reference_buffer_and_shrink_below():
    assert pe.probe_dims(32, 64, train_prompts=2048, train_rows=4096) == (32, 64)  # the reference buffer
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
    assert set(report["estimators"]["probe"]["correctness"]) == {"auroc", "brier", "ece", "share_right"}
    assert set(report["probe_minus_value_model"]) == {"pearson", "mae", "auroc"}
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
    reused = {"rollouts": "reused", "feature_blocks_computed": [], "value_model": "reused"}
    assert again["cache"] == report["cache"] | reused
    assert again["estimators"] == report["estimators"]

    # A new analysis setting reuses the rollouts.
    pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0], ridge_alpha=10.0),
                      show_progress=False)
    assert len(sampler_calls) == 1

    # A changed sampling setting samples afresh, into its own cache entry.
    changed = pe.run_probe_eval(settings(tiny_random_model_dir, toy_file, out, layers=[0], temperature=0.7),
                                show_progress=False)
    assert len(sampler_calls) == 2 and sampler_calls[-1]["temperature"] == 0.7
    assert changed["cache"]["rollouts"] == "sampled" and changed["cache"]["dir"] != report["cache"]["dir"]


def test_a_task_too_small_for_a_probe_is_reported_as_skipped(tmp_path, tiny_random_model_dir, sampler_calls):
    mix = tmp_path / "mix.yaml"  # 10 prompts shared 9:1, so chain_sum gets 1: a train prompt, none held out
    mix.write_text(f"dataset:\n  - {{name: {LEG_COUNTING}, weight: 9, {SHORT}}}\n  - {{name: {CHAIN_SUM}, {SHORT}}}\n")
    report = pe.run_probe_eval(settings(tiny_random_model_dir, mix, tmp_path / "out", limit=10, layers=[1]),
                               show_progress=False)
    assert [entry["name"] for entry in report["settings"]["dataset_source"]] == [LEG_COUNTING, CHAIN_SUM]
    small, large = report["by_task"][CHAIN_SUM], report["by_task"][LEG_COUNTING]
    assert (small["train_prompts"], small["heldout_prompts"]) == (1, 0) and "estimators" not in small
    assert small["skipped"].startswith("1 train prompt(s): its own probe needs at least 2")
    assert (large["train_prompts"], large["heldout_prompts"]) == (6, 3) and "skipped" not in large
    assert report["transfer"]["tasks"] == [LEG_COUNTING] and len(report["transfer"]["mae"]) == 1


# ----------------------------------------------------------------------------------------------- CLI


def cli(*args):
    app = typer.Typer()
    app.command()(probe_eval_command)
    result = CliRunner().invoke(app, [str(a) for a in args] + ["--engine", "transformers"])
    return result, result.output




def test_cli_defaults_are_the_library_defaults():
    import dataclasses
    import inspect

    library = {f.name: f.default for f in dataclasses.fields(pe.ProbeEvalSettings)
               if f.default is not dataclasses.MISSING}
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


def test_cli_on_a_task_mix_prints_per_task_and_transfer_tables(tmp_path, tiny_random_model_dir, sampler_calls):
    out, mix = tmp_path / "out", tmp_path / "mix.yaml"  # equal weights: 10 prompts each
    mix.write_text(f"dataset:\n  - {{name: {CHAIN_SUM}, {SHORT}}}\n  - {{name: {LEG_COUNTING}, {SHORT}}}\n")
    result, output = cli("--model", tiny_random_model_dir, "--dataset", mix, "--limit", 20,
                         "-n", 2, "--max-new-tokens", 4, "--value-epochs", 1, "--layers", "1", "-o", out,
                         "--no-progress")
    assert result.exit_code == 0, output
    assert "per task" in output and "transfer" in output and "task-only" in output
    assert "rollout AUROC" in output
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["split"] == "test"  # a task's held-out rows, as in `poise bench`
    assert set(report["by_task"]) == {CHAIN_SUM, LEG_COUNTING}
    transfer = report["transfer"]
    assert transfer["tasks"] == [CHAIN_SUM, LEG_COUNTING]
    assert [len(row) for row in transfer["mae"]] == [len(row) for row in transfer["pearson"]] == [2, 2]
    assert all(0 <= mae <= 1 for row in transfer["mae"] for mae in row)
    assert report["plots"]["transfer"] == str(out / "transfer.png") and (out / "transfer.png").is_file()

    # Each task's numbers agree with its cached rollouts: its share of the split, its own train mean.
    groups = [json.loads(line) for line in (Path(report["cache"]["dir"]) / "rollouts.jsonl").read_text().splitlines()]
    for i, (task, record) in enumerate(report["by_task"].items()):
        train = [p for p in report["split"]["train"] if groups[p]["task"] == task]
        heldout = [p for p in report["split"]["heldout"] if groups[p]["task"] == task]
        assert (record["train_prompts"], record["heldout_prompts"]) == (len(train), len(heldout)) == (7, 3)
        train_mean = sum(r["reward"] for p in train for r in groups[p]["rollouts"]) / (2 * len(train))
        empirical = [sum(r["reward"] for r in groups[p]["rollouts"]) / 2 for p in heldout]
        assert record["estimators"]["task_mean"]["mae"] == pytest.approx(
            sum(abs(train_mean - e) for e in empirical) / len(empirical))
        assert record["estimators"]["probe_task_only"]["mae"] == transfer["mae"][i][i]


def test_cli_errors_are_one_line_and_come_before_sampling(tmp_path, tiny_random_model_dir, sampler_calls):
    no_answers = tmp_path / "questions.jsonl"
    no_answers.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS))
    common = ("--model", tiny_random_model_dir, "-o", tmp_path / "out", "--no-progress")
    assert_one_line_error(*cli(*common, "--dataset", no_answers), "no answer column")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "--layers", "0,5"), "layer 5 is out of range")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "--layer", "1.5"), "layer 1.5 is out of range")
    assert_one_line_error(*cli(*common, "--dataset", "toy-arith", "-n", 1), "--n-samples must be >= 2")
    assert_one_line_error(*cli("--dataset", "toy-arith"), "--model")
    assert_one_line_error(*cli(*common, "--dataset", f"{CHAIN_SUM}+toy-arith"), "unknown task 'toy-arith'")
    assert_one_line_error(*cli(*common, "--dataset", tmp_path / "mix.yaml"), "no such mix file")
    assert not sampler_calls
