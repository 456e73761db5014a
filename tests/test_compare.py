"""`poise compare`: crossing and aggregation on hand-made curves, and a two-step budget end to
end (runs in subprocesses, skipped when complete, resumed from checkpoints)."""

import json
import shutil
from pathlib import Path

import pytest
import trl
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.run import compare
from poise_trl.run.callbacks import Budget
from poise_trl.run.recipe import load_recipe


def test_first_crossing_interpolates_between_evaluations():
    xs, ys = [0, 100, 200], [0.5, 0.6, 0.8]
    assert compare.first_crossing(xs, ys, 0.7) == pytest.approx(150)
    assert compare.first_crossing(xs, ys, 0.6) == 100  # reached exactly at an evaluation
    assert compare.first_crossing(xs, ys, 0.4) == 0  # already there at the start
    assert compare.first_crossing(xs, ys, 0.81) is None  # never reached
    # the first crossing counts, even if the curve falls back below the target afterwards
    assert compare.first_crossing([0, 100, 200, 300], [0.5, 0.72, 0.6, 0.8], 0.7) == pytest.approx(100 * 0.2 / 0.22)


def point(step, tokens, seconds, accuracy, budget_point=None):
    p = {"step": step, "generated_tokens": tokens, "generated_rollouts": tokens // 10, "train_seconds": seconds,
         "accuracy": accuracy, "stderr": 0.0}
    return p if budget_point is None else {**p, "budget_point": budget_point}


def test_aggregate_curves_over_seeds():
    seed0 = [point(0, 0, 0.0, 0.5), point(3, 110, 10.0, 0.6, 1), point(6, 205, 20.0, 0.7, 2)]
    seed1 = [point(0, 0, 0.0, 0.5), point(3, 100, 14.0, 0.7, 1), point(5, 201, 30.0, 0.9, 2)]
    curve = compare.aggregate_curves([seed0, seed1])
    assert [p["budget_point"] for p in curve] == [0, 1, 2]
    last = curve[2]
    assert last["accuracy_mean"] == pytest.approx(0.8)
    assert last["accuracy_std"] == pytest.approx(0.1414213, rel=1e-5)  # sample std of (0.7, 0.9)
    assert (last["accuracy_min"], last["accuracy_max"]) == (0.7, 0.9)
    assert last["generated_tokens_mean"] == pytest.approx(203)
    assert last["train_seconds_mean"] == pytest.approx(25) and last["train_seconds_std"] == pytest.approx(7.0710678)
    assert curve[0]["accuracy_std"] == 0.0
    # a seed that stopped short (max_steps cap) limits the aggregate to the points all seeds reached
    assert len(compare.aggregate_curves([seed0, seed1[:2]])) == 2


def test_budget_curve_keeps_start_and_budget_points_only():
    history = [point(0, 0, 0, 0.5), point(2, 50, 1, 0.55), point(4, 100, 2, 0.6, 1), point(8, 200, 4, 0.7, 2)]
    assert [p["step"] for p in compare.budget_curve(history)] == [0, 4, 8]


def test_log_series_and_binning():
    log = [
        {"grad_norm": 1.0, "probe/variance_reduction": -0.5, "generated_tokens": 10, "generated_rollouts": 1},
        {"grad_norm": 3.0, "probe/variance_reduction": 0.25, "probe/mae": 0.2, "generated_tokens": 20,
         "generated_rollouts": 2, "dapo/dropped_groups": 2, "dapo/generated_groups": 8},
        {"grad_norm": 5.0, "generated_tokens": 95, "generated_rollouts": 3},
        {"train_runtime": 9.0},  # Trainer's closing entry: no counters
    ]
    assert compare.log_series(log, "grad_norm") == [(10, 1.0), (20, 3.0), (95, 5.0)]
    assert compare.log_series(log, "grad_norm", unit="rollouts") == [(1, 1.0), (2, 3.0), (3, 5.0)]
    # bootstrap rounds (no probe MAE) are not the probe's variance reduction
    assert compare.log_series(log, "probe/variance_reduction") == [(20, 0.25)]
    assert compare.log_series(log, "dapo/dropped_fraction") == [(20, 0.25)]
    # budget 100 in 4 slices: 10 and 20 fall in the first, 95 in the last; 120 overshoots into the last
    assert compare.binned([(10, 1.0), (20, 3.0), (95, 5.0), (120, 7.0)], 100, bins=4) == [2.0, None, None, 6.0]


def fake_summary(seed, finals, seconds):
    """A run whose curve reaches accuracy finals[i] at budget point i+1 after seconds[i]."""
    history = [point(0, 0, 0.0, 0.5)] + [
        point(i + 1, 100 * (i + 1), s, a, i + 1) for i, (a, s) in enumerate(zip(finals, seconds, strict=True))
    ]
    return {"seed": seed, "algo": "x", "heldout_history": history, "generated_tokens": history[-1]["generated_tokens"],
            "generated_rollouts": 20, "train_seconds": seconds[-1], "steps": 10, "budget_reached": True,
            "train_log": [{"grad_norm": 1.0 + seed, "generated_tokens": 50, "generated_rollouts": 5}]}


def test_target_from_a_reference_run_and_wall_clock_ratio(tmp_path):
    budget = Budget("tokens", 200, points=2)
    runs = []
    for name, per_seed in {
        "dapo": [([0.6, 0.7], [40.0, 80.0]), ([0.6, 0.7], [40.0, 80.0])],
        "poise": [([0.7, 0.8], [30.0, 60.0]), ([0.6, 0.8], [30.0, 60.0])],
    }.items():
        for seed, (finals, seconds) in enumerate(per_seed):
            run = compare.PlannedRun(name, tmp_path / f"{name}.yaml", seed, tmp_path / name / str(seed))
            run.folder.mkdir(parents=True)
            (run.folder / "summary.json").write_text(json.dumps(fake_summary(seed, finals, seconds)))
            runs.append(run)
    report = compare.aggregate(runs, budget, "dapo", {"dapo": {}, "poise": {}})
    assert report["target"] == {"accuracy": pytest.approx(0.7), "reference": "dapo"}
    dapo, poise = report["results"]["dapo"], report["results"]["poise"]
    assert dapo["to_target"]["seconds"] == pytest.approx(80.0) and dapo["to_target"]["tokens"] == pytest.approx(200)
    # POISE's mean curve: 0.5 at 0 s, 0.65 at 30 s, 0.8 at 60 s -> 0.7 at 30 + (0.05 / 0.15) * 30 = 40 s
    assert poise["to_target"]["seconds"] == pytest.approx(40.0)
    assert poise["to_target"]["seconds_ratio_to_reference"] == pytest.approx(0.5)
    assert poise["to_target"]["tokens"] == pytest.approx(100 + 100 / 3)
    # per seed: seed 0 reaches 0.7 at 30 s exactly, seed 1 at 30 + (0.1 / 0.2) * 30 = 45 s
    assert [r["seconds_to_target"] for r in poise["runs"]] == [pytest.approx(30.0), pytest.approx(45.0)]
    assert poise["to_target"]["seeds_reached"] == 2
    assert poise["final_accuracy"]["mean"] == pytest.approx(0.8)
    assert poise["signals_mean"]["grad_norm"] == pytest.approx(1.5)
    # no per-prompt results and no standard errors in these runs: the difference redraws seeds only
    assert list(report["differences"]) == ["dapo - start", "poise - start", "dapo - poise"]
    difference = report["differences"]["dapo - poise"]
    assert difference["final"]["diff"] == pytest.approx(-0.1)
    assert difference["final"]["ci95"] == pytest.approx([-0.1, -0.1])
    with pytest.raises(compare.CompareError, match="neither an accuracy nor one of the runs"):
        compare.aggregate(runs, budget, "grpo", {})
    assert compare.aggregate(runs, budget, "0.75", {})["results"]["dapo"]["to_target"]["seconds"] is None
    tables = compare.table_rows(report)
    assert tables[1][1][4] == "s ratio vs dapo" and tables[1][2][1][4] == "0.50"


def test_train_command_overrides_and_launcher(tmp_path):
    run = compare.PlannedRun("poise", tmp_path / "poise.yaml", 2, tmp_path / "runs" / "poise" / "seed2")
    settings = compare.run_overrides(run, Budget("tokens", 1000, 5), ["eval_limit=50"], max_steps=500)
    # the sweep's settings come after the user's, so they win
    assert settings.index("eval_limit=50") < settings.index("seed=2")
    for setting in ("budget_tokens=1000", "budget_eval_points=5", "eval_every=0", "max_steps=500"):
        assert setting in settings
    command = compare.train_command(run, settings, resume=True, show_progress=False,
                                    launcher=["accelerate", "launch", "--num_processes", "2"])
    assert command[:6] == ["accelerate", "launch", "--num_processes", "2", "-m", "poise_trl.cli.main"]
    assert command[6:8] == ["train", str(run.recipe_path)] and "--no-progress" in command
    assert command[-1] == "resume_from_checkpoint=true" and set(settings) <= set(command)


def test_run_names_disambiguate_colliding_stems(tmp_path):
    from pathlib import Path

    assert compare.run_names([Path("recipes/toy/grpo.yaml"), Path("recipes/toy/poise.yaml")]) == ["grpo", "poise"]
    assert compare.run_names([Path("a/grpo.yaml"), Path("b/grpo.yaml")]) == ["a-grpo", "b-grpo"]


# ---------------------------------------------------------------------------------------
# End to end: two recipes x two seeds, a two-step budget
# ---------------------------------------------------------------------------------------


def write_recipe(path, model_dir, algo):
    settings = {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "eval_num_samples": 1, "eval_max_new_tokens": 8, "num_generations": 2, "per_device_train_batch_size": 4,
        "max_completion_length": 8, "save_steps": 1, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
    }
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in settings.items()) + "\n")
    return path


def run_compare(*args):
    result = CliRunner().invoke(app, ["compare", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_compare_two_step_budget_resumes_and_skips(tmp_path, tiny_random_model_dir):
    recipes = [write_recipe(tmp_path / f"{algo}.yaml", tiny_random_model_dir, algo) for algo in ("grpo", "rloo")]
    out = tmp_path / "cmp"
    args = [*recipes, "--budget-rollouts", 8, "--eval-points", 2, "--seeds", 2, "-o", out, "--no-progress",
            "--target", "grpo"]
    output = run_compare(*args)
    assert "poise compare: 8 generated rollouts per run" in output and "compare.json" in output
    report = json.loads((out / "compare.json").read_text())
    assert report["budget"] == {"unit": "rollouts", "amount": 8, "points": 2}
    for name in ("grpo", "rloo"):
        result = report["results"][name]
        assert result["seeds"] == [0, 1] and result["all_reached_budget"]
        assert [p["budget_point"] for p in result["curve"]] == [0, 1, 2]
        assert all(r["generated_rollouts"] == 8 and r["steps"] == 2 for r in result["runs"])
    assert report["versions"]["trl"] == trl.__version__
    # every held-out evaluation kept its per-prompt results, so the differences redraw prompts too
    assert report["differences"]["grpo - rloo"]["noise"] == "seeds and held-out prompts"
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "training_signals.png").stat().st_size > 1000

    # Complete runs are skipped: a rerun trains nothing and reproduces the report.
    summaries = sorted(out.glob("runs/*/seed*/summary.json"))
    stamps = [p.stat().st_mtime_ns for p in summaries]
    output = run_compare(*args)
    assert output.count("complete, skipped") == 4
    assert [p.stat().st_mtime_ns for p in summaries] == stamps
    assert json.loads((out / "compare.json").read_text())["results"] == report["results"]

    # An interrupted run (checkpoint-1 only, no summary) resumes from its checkpoint.
    run = out / "runs" / "rloo" / "seed1"
    before = json.loads((run / "summary.json").read_text())
    for path in [run / "summary.json", run / "final", run / "checkpoint-2"]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    output = run_compare(*args)
    assert "rloo seed 1: resuming from its newest checkpoint" in output and output.count("complete, skipped") == 3
    after = json.loads((run / "summary.json").read_text())
    assert (after["steps"], after["generated_rollouts"]) == (2, 8)
    assert [p["step"] for p in after["heldout_history"]] == [0, 1, 2]
    assert all(len(p["per_prompt"]) == p["num_prompts"] for p in after["heldout_history"])
    assert after["generated_tokens"] == before["generated_tokens"]  # same rollouts as the uninterrupted run


def test_compare_refuses_a_folder_made_with_other_settings(tmp_path, tiny_random_model_dir):
    recipe = write_recipe(tmp_path / "grpo.yaml", tiny_random_model_dir, "grpo")
    run = compare.PlannedRun("grpo", recipe, 0, tmp_path / "cmp" / "runs" / "grpo" / "seed0")
    budget = Budget("rollouts", 8, 4)
    expected = load_recipe(recipe, compare.run_overrides(run, budget, [], 100))
    assert compare.run_status(run, expected) == "new"
    run.folder.mkdir(parents=True)
    (run.folder / "summary.json").write_text(json.dumps({"recipe": {**expected, "resume_from_checkpoint": True}}))
    assert compare.run_status(run, expected) == "complete"  # resumed on the way: still the same run
    other = load_recipe(recipe, compare.run_overrides(run, Budget("tokens", 8, 4), ["learning_rate=0.1"], 100))
    with pytest.raises(compare.CompareError, match="differing: budget_rollouts, budget_tokens, learning_rate"):
        compare.run_status(run, other)
    # through the command: one line, nothing run
    result = CliRunner().invoke(app, ["compare", str(recipe), "--budget-rollouts", "8", "--seeds", "1",
                                      "--set", "learning_rate=0.1", "-o", str(tmp_path / "cmp")])
    assert result.exit_code == 2 and "another --output-dir" in result.output


@pytest.mark.parametrize("args, message", [
    ([], "exactly one budget"),
    (["--budget-tokens", "10", "--budget-rollouts", "10"], "exactly one budget"),
    (["--budget-tokens", "10", "--set", "lerning_rate=1"], "did you mean 'learning_rate'"),
])
def test_compare_bad_arguments_fail_before_any_run(tmp_path, tiny_random_model_dir, args, message):
    recipe = write_recipe(tmp_path / "grpo.yaml", tiny_random_model_dir, "grpo")
    result = CliRunner().invoke(app, ["compare", str(recipe), "-o", str(tmp_path / "cmp"), *args])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "cmp" / "runs").exists()


def test_zero_signal_fraction_from_trl_and_dapo_logs():
    from poise_trl.run.compare import log_series

    log = [
        {"generated_tokens": 100, "frac_reward_zero_std": 0.25},
        {"generated_tokens": 200, "dapo/generated_groups": 16, "dapo/informative_groups": 6,
         "frac_reward_zero_std": 0.0},
        {"generated_tokens": 300},
    ]
    assert log_series(log, "zero_signal_fraction") == [(100, 0.25), (200, 10 / 16)]


def test_selection_counters_and_a2po_stage_1_zero_signal_share(tmp_path):
    budget = Budget("tokens", 200, points=2)
    select_log = [
        {"generated_tokens": 50, "generated_rollouts": 4, "frac_reward_zero_std": 0.5,
         "selection/candidates_scored": 64.0, "selection/prompts_skipped": 32.0, "selection/prefill_tokens": 900.0,
         "selection/zero_signal_probe": 0.25, "selection/zero_signal_floor": 0.75},
        {"generated_tokens": 150, "generated_rollouts": 8, "frac_reward_zero_std": 0.25,
         "selection/candidates_scored": 128.0, "selection/prompts_skipped": 64.0, "selection/prefill_tokens": 1800.0,
         "selection/zero_signal_probe": 0.5, "selection/zero_signal_floor": 1.0},
    ]
    # A*-PO: 600 stage-1 rollouts (all zero-signal) + 2 of the 400 stage-2 rollouts with target 0
    a2po_log = [{"generated_tokens": 150, "generated_rollouts": 1000, "zero_signal_fraction": 0.005,
                 "zero_signal_rollouts": 602}]
    runs = []
    for name, log in (("poise_select", select_log), ("a2po", a2po_log)):
        run = compare.PlannedRun(name, tmp_path / f"{name}.yaml", 0, tmp_path / name / "0")
        run.folder.mkdir(parents=True)
        (run.folder / "summary.json").write_text(json.dumps({**fake_summary(0, [0.6, 0.7], [1.0, 2.0]),
                                                             "train_log": log}))
        runs.append(run)
    report = compare.aggregate(runs, budget, None, {"poise_select": {}, "a2po": {}})
    selection = report["results"]["poise_select"]["selection"]
    assert selection["selection/candidates_scored"] == 128.0 and selection["selection/prompts_skipped"] == 64.0
    assert selection["selection/zero_signal_probe"] == pytest.approx(0.375)
    assert selection["selection/zero_signal_floor"] == pytest.approx(0.875)
    assert selection["selection/informativeness_pool"] is None  # never logged
    assert report["results"]["poise_select"]["signals_mean"]["zero_signal_fraction"] == pytest.approx(0.375)
    assert "selection" not in report["results"]["a2po"]
    assert report["results"]["a2po"]["signals_mean"]["zero_signal_fraction"] == pytest.approx(0.602)
    title, header, rows = compare.table_rows(report)[-1]
    assert title.startswith("prompt selection") and rows == [["poise_select", "128", "64", "1800", "0.375", "0.875",
                                                               "-", "-"]]


def test_critic_explained_variance_over_the_second_half_and_seeds_below_start(tmp_path):
    budget = Budget("tokens", 200, points=2)
    # Explained variance 0.0, 0.1 (first half) then 0.3, 0.5 (second half): the table shows 0.4 for seed 0.
    critic_log = [{"generated_tokens": 50 * (i + 1), "generated_rollouts": 4, "critic/explained_variance": ev,
                   "critic/explained_variance_first_token": ev + 0.1, "critic/mc_sign_agreement": 0.9}
                  for i, ev in enumerate((0.0, 0.1, 0.3, 0.5))]
    runs = []
    # Every seed starts at 0.5; seed 1 of asyppo ends below it.
    for name, log, per_seed_finals in (("asyppo", critic_log, ([0.6, 0.7], [0.6, 0.45])),
                                       ("grpo", [{"generated_tokens": 50}], ([0.6, 0.7], [0.6, 0.7]))):
        for seed, finals in enumerate(per_seed_finals):
            run = compare.PlannedRun(name, tmp_path / f"{name}.yaml", seed, tmp_path / name / str(seed))
            run.folder.mkdir(parents=True)
            shifted = [{**e, "critic/explained_variance": e["critic/explained_variance"] + 0.2 * seed}
                       if "critic/explained_variance" in e else e for e in log]
            (run.folder / "summary.json").write_text(json.dumps({**fake_summary(seed, finals, [1.0, 2.0]),
                                                                 "train_log": shifted}))
            runs.append(run)
    report = compare.aggregate(runs, budget, None, {"asyppo": {}, "grpo": {}})
    asyppo, grpo = report["results"]["asyppo"], report["results"]["grpo"]
    assert [r["critics_second_half"]["critic/explained_variance"] for r in asyppo["runs"]] == [
        pytest.approx(0.4), pytest.approx(0.6)]
    assert asyppo["critics_second_half"]["critic/explained_variance"]["mean"] == pytest.approx(0.5)
    assert asyppo["critics_second_half"]["critic/explained_variance_first_token"]["mean"] == pytest.approx(0.5)
    assert asyppo["seeds_below_start"] == 1 and grpo["seeds_below_start"] == 0
    assert "critics_second_half" not in grpo
    title, header, rows = compare.table_rows(report)[-1]
    assert title.startswith("critics, second half")
    assert rows == [["asyppo", "0.500 ± 0.141", "0.500 ± 0.000", "0.900 ± 0.000", "1/2"]]


# The command that made benchmarks/results/compare_aggregate_check (its run summaries are committed with it).
AGGREGATE_CHECK = ["recipes/toy/poise.yaml", "recipes/toy/grpo_2.yaml", "--budget-tokens", "10000", "--seeds", "2",
                   "--eval-points", "2", "--set", "eval_limit=40"]


def test_aggregate_only_reproduces_a_committed_study(tmp_path, monkeypatch):
    """`poise compare --aggregate-only` on a study's committed run summaries gives back its compare.json (package
    versions aside): a reader can regenerate the tables and plots from the repository alone."""
    repo = Path(__file__).resolve().parents[1]
    committed = repo / "benchmarks" / "results" / "compare_aggregate_check"
    shutil.copytree(committed, tmp_path / "study")
    (tmp_path / "study" / "compare.json").unlink()
    monkeypatch.chdir(repo)  # the recipe paths as the study's command gave them
    result = CliRunner().invoke(app, ["compare", *AGGREGATE_CHECK, "--aggregate-only", "-o", str(tmp_path / "study")])
    assert result.exit_code == 0, result.output
    again, original = (json.loads(p.read_text()) for p in (tmp_path / "study" / "compare.json",
                                                            committed / "compare.json"))
    again.pop("versions"), original.pop("versions")
    assert again == original


def curves_with_prompts(rng, arms_accuracy: dict[str, list[float]], seeds: int, prompts: int = 100,
                        samples: int = 4):
    """Budget curves per arm and seed whose per-prompt Avg@k draws each prompt's success from the arm's
    accuracy at that point (each prompt's difficulty shared by the arms of a seed: one held-out set)."""
    import numpy as np

    out = {name: [] for name in arms_accuracy}
    for _ in range(seeds):
        difficulty = rng.normal(0, 1.0, prompts)
        for name, accuracies in arms_accuracy.items():
            curve = []
            for point_index, accuracy in enumerate(accuracies):
                logit = np.log(accuracy / (1 - accuracy)) + difficulty
                per_prompt = (rng.binomial(samples, 1 / (1 + np.exp(-logit))) / samples).tolist()
                curve.append({**point(point_index, 100 * point_index, 1.0, float(np.mean(per_prompt)),
                                      point_index or None), "per_prompt": per_prompt,
                              "stderr": float(np.std(per_prompt, ddof=1) / np.sqrt(prompts))})
            out[name].append(curve)
    return out


def test_paired_difference_resolves_a_known_effect_and_not_a_null_one():
    import numpy as np

    rng = np.random.default_rng(1)
    curves = curves_with_prompts(rng, {"better": [0.4, 0.55, 0.65], "same": [0.4, 0.4, 0.4],
                                       "same_again": [0.4, 0.4, 0.4]}, seeds=3)
    effect = compare.paired_difference(curves["better"], curves["same"])
    assert effect["noise"] == "seeds and held-out prompts" and effect["seeds"] == 3
    low, high = effect["final"]["ci95"]
    assert effect["final"]["resolved"] and 0 < low < effect["final"]["diff"] < high
    assert 0.15 < effect["final"]["diff"] < 0.35 and effect["area"]["resolved"]
    assert effect["area"]["diff"] < effect["final"]["diff"]  # the curve rises: its mean lies under its end
    differences = compare.paired_differences(curves, {name: [0, 1, 2] for name in curves})
    assert list(differences)[:3] == ["better - start", "same - start", "same_again - start"]
    assert differences["better - start"]["final"]["resolved"]
    assert not differences["same - start"]["final"]["resolved"]
    assert differences["better - same"] == effect
    null = compare.paired_difference(curves["same"], curves["same_again"])
    assert not null["final"]["resolved"] and null["final"]["ci95"][0] < 0 < null["final"]["ci95"][1]
    # runs without per-prompt results: the held-out sample's noise comes from each evaluation's standard error
    older = {name: [[{k: v for k, v in p.items() if k != "per_prompt"} for p in c] for c in curves[name]]
             for name in curves}
    effect, null = (compare.paired_difference(older[a], older[b]) for a, b in (("better", "same"),
                                                                               ("same", "same_again")))
    assert effect["noise"].startswith("seeds and held-out sample (normal")
    assert effect["final"]["resolved"] and not null["final"]["resolved"]
    seeds_only = compare.paired_difference([[{**p, "stderr": 0.0} for p in c] for c in older["same"]],
                                           [[{**p, "stderr": 0.0} for p in c] for c in older["same_again"]])
    width = lambda d: d["final"]["ci95"][1] - d["final"]["ci95"][0]  # noqa: E731
    assert seeds_only["final"]["diff"] == pytest.approx(null["final"]["diff"])
    assert width(null) > width(seeds_only)


def test_paired_difference_intervals_cover_a_null_difference_about_95_percent_of_the_time():
    import numpy as np

    rng = np.random.default_rng(7)
    covered, covered_without_prompts = 0, 0
    for _ in range(60):
        curves = curves_with_prompts(rng, {"a": [0.4, 0.5], "b": [0.4, 0.5]}, seeds=3, prompts=60)
        covered += not compare.paired_difference(curves["a"], curves["b"], samples=500)["final"]["resolved"]
        older = [[[{k: v for k, v in p.items() if k != "per_prompt"} for p in c] for c in curves[name]]
                 for name in ("a", "b")]
        covered_without_prompts += not compare.paired_difference(*older, samples=500)["final"]["resolved"]
    # 95% nominal (both err wide); redrawing the 3 seeds alone covers about 3 in 4
    assert covered >= 54 and covered_without_prompts >= 54


def test_differences_table_says_resolved_or_not():
    report = {"target": None, "results": {}, "differences": {
        "poise - grpo": {"seeds": 3, "noise": "seeds and held-out prompts",
                         "final": {"diff": 0.018, "ci95": [-0.02, 0.05], "resolved": False},
                         "area": {"diff": 0.03, "ci95": [0.01, 0.05], "resolved": True}},
    }}
    title, header, rows = next(t for t in compare.table_rows(report) if t[0].startswith("paired differences"))
    assert rows[0] == ["poise - grpo", "3", "+0.018 [-0.020, +0.050]", "not resolved",
                       "+0.030 [+0.010, +0.050]", "resolved", "seeds and held-out prompts"]


def test_paired_difference_per_task_resolves_the_task_that_moved():
    import numpy as np

    rng = np.random.default_rng(3)
    arms = {"grpo": {"a": [0.4, 0.7], "b": [0.4, 0.4]}, "start": {"a": [0.4, 0.4], "b": [0.4, 0.4]}}
    curves = {name: [] for name in arms}
    for _ in range(3):  # seeds: task a's 100 prompts then task b's, one held-out set for both arms
        per_task = {task: curves_with_prompts(rng, {n: arms[n][task] for n in arms}, seeds=1) for task in "ab"}
        for name in arms:
            curves[name].append([{**pa, "per_prompt": pa["per_prompt"] + pb["per_prompt"],
                                  "per_prompt_task": ["a"] * 100 + ["b"] * 100}
                                 for pa, pb in zip(per_task["a"][name][0], per_task["b"][name][0], strict=True)])
    difference = compare.paired_difference(curves["grpo"], curves["start"])
    by_task = difference["by_task"]
    assert list(by_task) == ["a", "b"] and by_task["a"]["final"]["resolved"]
    assert 0.15 < by_task["a"]["final"]["diff"] < 0.45 and not by_task["b"]["final"]["resolved"]
    assert by_task["a"]["final"]["diff"] > difference["final"]["diff"] > by_task["b"]["final"]["diff"]
    report = {"target": None, "results": {}, "differences": {"grpo - start": difference}}
    title, header, rows = next(t for t in compare.table_rows(report) if t[0].startswith("paired differences per"))
    assert [row[:2] for row in rows] == [["grpo - start", "a"], ["grpo - start", "b"]]
    assert rows[0][3] == "resolved" and rows[1][3] == "not resolved"


def test_a_held_out_evaluation_on_a_mix_names_each_prompts_task(bundled_model_dir):
    from poise_trl.core.loading import load_causal_lm, load_tokenizer
    from poise_trl.engines.generation import TransformersEngine, evaluate_accuracy
    from poise_trl.tasks import by_task_means, load_prompt_dataset

    mix = [{"name": "reasoning-gym:chain_sum", "config": {"system_prompt": "direct"}},
           {"name": "reasoning-gym:leg_counting", "config": {"system_prompt": "direct"}}]
    rows = load_prompt_dataset(mix, limit=6, seed=0)
    engine = TransformersEngine(load_causal_lm(str(bundled_model_dir)), load_tokenizer(str(bundled_model_dir)), 8)
    result = evaluate_accuracy(engine, rows, num_samples=2, max_new_tokens=8, keep_per_prompt=True)
    assert result["per_prompt_task"] == rows["task"] and len(result["per_prompt"]) == 6
    assert result["by_task"] == pytest.approx(by_task_means(result["per_prompt_task"], result["per_prompt"]))
    assert "per_prompt_task" not in evaluate_accuracy(engine, rows.remove_columns("task"), max_new_tokens=4,
                                                      keep_per_prompt=True)
