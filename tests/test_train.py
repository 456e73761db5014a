"""End to end through `train_from_recipe` on a 2-layer random model: the real TRL path, seconds."""

import json
import shutil

import pytest
import torch
import trl
from helpers import VARYING_REWARD, assert_saved_weights_moved, saved_tensors

from poise_trl.run.recipe import RecipeError, load_recipe
from poise_trl.run.train import train_from_recipe


def tiny_recipe(tmp_path, model_dir, algo="grpo", **extra):
    lines = {
        "algo": algo,
        "model": str(model_dir),
        "dataset": "toy-arith",
        "dataset_size": 32,
        "eval_limit": 8,
        "eval_every": 1,
        "eval_num_samples": 1,
        "eval_max_new_tokens": 16,
        "num_generations": 2,
        "per_device_train_batch_size": 4,
        "max_completion_length": 16,
        "max_steps": 2,
        "logging_steps": 1,
        "save_steps": 1,
        "learning_rate": 1e-3,
        "seed": 0,
        "rewards": [VARYING_REWARD],
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in lines.items()) + "\n")
    return load_recipe(path)


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_two_step_run_writes_summary_and_checkpoints(tmp_path, tiny_random_model_dir, algo):
    out = tmp_path / "run"
    summary = train_from_recipe(tiny_recipe(tmp_path, tiny_random_model_dir, algo), str(out), show_progress=False)
    assert summary["steps"] == 2
    written = json.loads((out / "summary.json").read_text())
    assert written["algo"] == algo
    assert written["start_heldout_accuracy"] is not None and written["final_heldout_accuracy"] is not None
    assert [h["step"] for h in written["heldout_history"]] == [0, 1, 2]
    assert written["versions"]["trl"] == trl.__version__  # the TRL that ran it (CI runs 1.14 and 1.16)
    assert written["recipe"]["algo"] == algo
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    assert (out / "recipe.yaml").exists()


def test_lora_run(tmp_path, tiny_random_model_dir):
    recipe = tiny_recipe(tmp_path, tiny_random_model_dir,
                         peft={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    out = tmp_path / "lora"
    summary = train_from_recipe(recipe, str(out), show_progress=False)
    assert summary["steps"] == 2
    assert (out / "final" / "adapter_model.safetensors").exists()
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")


def test_poise_run_writes_probe_report_and_plot(tmp_path, tiny_random_model_dir):
    recipe = tiny_recipe(tmp_path, tiny_random_model_dir, "poise", probe_bootstrap_steps=1,
                         probe_prompt_components=4, probe_response_components=4)
    out = tmp_path / "poise"
    train_from_recipe(recipe, str(out), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    report = json.loads((out / "probe_report.json").read_text())
    assert report["rounds"] == 2 and report["probe_active_rounds"] == 1
    assert report["per_round"][1]["probe_active"] is True
    assert report["versions"]["trl"] == trl.__version__
    assert (out / "probe_values.png").stat().st_size > 1000
    assert (out / "checkpoint-2" / "poise_probe.safetensors").exists()


def budget_recipe(tmp_path, model_dir, **extra):
    # 4 rollouts per step: a budget of 8 rollouts is two steps, evaluated at 4 and 8.
    settings = {"eval_every": 0, "max_steps": 100, "budget_rollouts": 8, "budget_eval_points": 2, **extra}
    return tiny_recipe(tmp_path, model_dir, **settings)


def test_budget_stops_the_run_and_records_compute_at_each_point(tmp_path, tiny_random_model_dir):
    out = tmp_path / "budget"
    summary = train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir), str(out), show_progress=False)
    assert summary["steps"] == 2 and summary["budget_reached"] is True
    assert summary["generated_rollouts"] == 8
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    points = summary["heldout_history"]
    assert [(p["step"], p.get("budget_point")) for p in points] == [(0, None), (1, 1), (2, 2)]
    assert [p["generated_rollouts"] for p in points] == [0, 4, 8]
    assert 0 < points[1]["generated_tokens"] < points[2]["generated_tokens"] == summary["generated_tokens"]
    assert 0 == points[0]["train_seconds"] < points[1]["train_seconds"] < points[2]["train_seconds"]
    # every training log entry carries the counters: the x-axis of compare's curves
    steps = [e for e in summary["train_log"] if "grad_norm" in e]
    assert [e["generated_rollouts"] for e in steps] == [4, 8]
    ledger = json.loads((out / "checkpoint-2" / "heldout_ledger.json").read_text())
    assert ledger["generated_rollouts"] == 8 and len(ledger["history"]) == 3


def test_interrupted_budget_run_resumes_with_its_curve_and_counters(tmp_path, tiny_random_model_dir):
    whole = train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir), str(tmp_path / "whole"),
                              show_progress=False)
    out = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", out)
    # a run killed after checkpoint-1, with half the budget spent
    for name in ("summary.json", "final", "checkpoint-2"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    first = json.loads((out / "checkpoint-1" / "heldout_ledger.json").read_text())
    assert first["generated_rollouts"] == 4
    resumed = train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir, resume_from_checkpoint=True), str(out),
                                show_progress=False)
    assert resumed["steps"] == 2 and resumed["budget_reached"] is True
    assert resumed["generated_rollouts"] == 8
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    assert [p["step"] for p in resumed["heldout_history"]] == [0, 1, 2]
    # the resumed run draws and learns what the uninterrupted one did: same tokens, same losses, the same final
    # weights and optimizer state bit for bit (the weights moved, so a resume that lost a step would differ)
    assert resumed["generated_tokens"] == whole["generated_tokens"]
    losses = [[e["loss"] for e in run["train_log"] if "loss" in e] for run in (whole, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    whole_weights, resumed_weights = saved_tensors(tmp_path / "whole" / "final"), saved_tensors(out / "final")
    assert all(torch.equal(whole_weights[name], resumed_weights[name]) for name in whole_weights)
    optimizers = [torch.load(run / "checkpoint-2" / "optimizer.pt", weights_only=False)["state"]
                  for run in (tmp_path / "whole", out)]
    assert all(torch.equal(optimizers[0][i][key], optimizers[1][i][key])
               for i in optimizers[0] for key in ("exp_avg", "exp_avg_sq"))
    assert [p["accuracy"] for p in resumed["heldout_history"]] == [p["accuracy"] for p in whole["heldout_history"]]
    assert resumed["train_seconds"] > first["train_seconds"]
    # resuming from the checkpoint written when the budget ran out (killed before the summary) trains nothing more
    (out / "summary.json").unlink()
    again = train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir, resume_from_checkpoint=True), str(out),
                              show_progress=False)
    assert (again["steps"], again["generated_rollouts"]) == (2, 8)
    assert again["heldout_history"] == resumed["heldout_history"]


def test_budget_settings_are_checked(tmp_path, tiny_random_model_dir):
    with pytest.raises(RecipeError, match="not both"):
        train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir, budget_tokens=100), str(tmp_path / "x"),
                          show_progress=False)
    with pytest.raises(RecipeError, match="holds no checkpoint"):
        train_from_recipe(budget_recipe(tmp_path, tiny_random_model_dir, resume_from_checkpoint=True),
                          str(tmp_path / "empty"), show_progress=False)
