"""`report_to: trackio` and `report_to: wandb` (offline), end to end: a `poise train` run's metrics (POISE's
probe metrics, per-task rewards, AsyPPO's critic explained variance) and its completion table
(`log_completions: true`), read back from the tracker's local store with the tracker's own reader
(`trackio get metric --json`, `wandb leet inspect --json`) and checked against completions.jsonl."""

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import VARYING_REWARD, assert_saved_weights_moved

from poise_trl.core.completions import COMPLETIONS_FILE

TESTS = Path(__file__).parent  # the recipes' reward lives in tests/helpers.py
CHAIN_SUM, LEG_COUNTING = "reasoning-gym:chain_sum", "reasoning-gym:leg_counting"
SHORT_PROMPT = {"system_prompt": "direct"}


def tiny_recipe(model_dir, algo, **extra) -> dict:
    return {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "eval_every": 2, "eval_num_samples": 1, "eval_max_new_tokens": 8, "num_generations": 4,
        "per_device_train_batch_size": 8, "max_completion_length": 12, "max_steps": 2, "logging_steps": 1,
        "save_steps": 100, "learning_rate": 1e-3, "seed": 0, "rewards": [VARYING_REWARD], "log_completions": True,
        "num_completions_to_print": 1, **extra,
    }


def poise_train(recipe: dict, out: Path, env: dict) -> None:
    path = out.parent / f"{out.name}.yaml"
    path.write_text("\n".join(f"{key}: {json.dumps(value)}" for key, value in recipe.items()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])), **env}
    command = [sys.executable, "-m", "poise_trl.cli.main", "train", str(path), "-o", str(out), "--no-progress"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def jsonl_by_step(out: Path) -> dict[int, list[dict]]:
    steps = defaultdict(list)
    for line in (out / COMPLETIONS_FILE).read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]].append(row)
    return dict(steps)


def mean_reward(rows: list[dict]) -> float:
    return sum(row["reward"] for row in rows) / len(rows)


def trackio_metric(trackio_dir: Path, project: str, run: str, metric: str) -> list[dict]:
    """[{step, value, timestamp}] of one metric: trackio's CLI, reading its local database."""
    command = [sys.executable, "-m", "trackio.cli", "get", "metric", "--project", project, "--run", run,
               "--metric", metric, "--json"]
    result = subprocess.run(command, env={**os.environ, "TRACKIO_DIR": str(trackio_dir)}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)["values"]


def wandb_history(wandb_dir: Path) -> tuple[Path, list[dict]]:
    """The offline run's folder and its history rows: wandb's own reader of the run's .wandb log."""
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return run_dir, [r["history"]["item"] for r in records if r["type"] == "history"]


@pytest.mark.slow
def test_trackio_holds_probe_and_task_metrics_and_the_completion_table(tmp_path, tiny_random_model_dir):
    pytest.importorskip("trackio")
    trackio_dir, project, run, out = tmp_path / "trackio", "poise-readback", "poise-mix", tmp_path / "run"
    mix = [{"name": CHAIN_SUM, "config": SHORT_PROMPT}, {"name": LEG_COUNTING, "config": SHORT_PROMPT}]
    poise_train(tiny_recipe(tiny_random_model_dir, "poise", dataset=mix, dataset_size=8, eval_limit=2,
                            rewards=["task", VARYING_REWARD], num_generations=2, probe_bootstrap_steps=1,
                            probe_buffer_rows=64, probe_domain_column=None, report_to="trackio", project=project,
                            run_name=run),
                out, {"TRACKIO_DIR": str(trackio_dir)})
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    rows = jsonl_by_step(out)
    assert sorted(rows) == [1, 2]

    def by_global_step(metric: str) -> dict[int, float]:
        # trackio numbers its own log calls; TRL's `train/global_step` goes with each of them
        global_steps = {v["step"]: v["value"] for v in trackio_metric(trackio_dir, project, run, "train/global_step")}
        return {global_steps[v["step"]]: v["value"] for v in trackio_metric(trackio_dir, project, run, metric)}

    rewards = by_global_step("train/reward")
    assert {step: rewards[step] for step in rows} == pytest.approx({s: mean_reward(r) for s, r in rows.items()})
    for task in (CHAIN_SUM, LEG_COUNTING):
        logged = by_global_step(f"train/rewards/task/{task}/mean")
        mine = {step: [row for row in group if row["task"] == task] for step, group in rows.items()}
        mine = {step: group for step, group in mine.items() if group}
        assert mine, task  # two steps of 4 prompts draw all 8 rows, so every task is in some step
        expected = {step: mean_reward(group) for step, group in mine.items()}
        assert {step: logged[step] for step in mine} == pytest.approx(expected)
    variance_reduction = by_global_step("train/probe/variance_reduction")
    assert set(variance_reduction) == {1, 2} and all(math.isfinite(v) for v in variance_reduction.values())
    for metric in ("train/probe/mae", "train/probe/pearson"):  # once the probe predicts (step 2)
        assert math.isfinite(by_global_step(metric)[2]), metric

    tables = trackio_metric(trackio_dir, project, run, "completions")
    assert tables and tables[-1]["value"]["_type"] == "trackio.table"
    table = tables[-1]["value"]["_value"]  # the latest round: step 2
    columns = ("step", "advantage", "baseline", "task")
    assert [[r[c] for c in columns] for r in table] == [[r[c] for c in columns] for r in rows[2]]
    for row in rows[2]:
        assert row["reward"] == pytest.approx(row["baseline"] + row["advantage"], abs=1e-6)


@pytest.mark.slow
def test_wandb_offline_holds_critic_explained_variance_and_the_completion_table(tmp_path, tiny_random_model_dir):
    pytest.importorskip("wandb")
    out, wandb_dir = tmp_path / "run", tmp_path / "wandb"
    wandb_dir.mkdir()
    poise_train(tiny_recipe(tiny_random_model_dir, "asyppo", report_to="wandb"), out,
                {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_PROJECT": "poise-readback"})
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    rows = jsonl_by_step(out)
    run_dir, history = wandb_history(wandb_dir)

    metrics = {item["train/global_step"]: item for item in history if "train/reward" in item}
    assert sorted(metrics) == sorted(rows) == [1, 2]
    for step, group in rows.items():
        assert metrics[step]["train/reward"] == pytest.approx(mean_reward(group))
        assert math.isfinite(metrics[step]["train/critic/explained_variance"])

    tables = {item["train/global_step"]: item for item in history if item.get("completions._type") == "table-file"}
    for step, group in rows.items():
        table = json.loads((run_dir / "files" / tables[step]["completions.path"]).read_text())
        assert table["columns"] == ["step", "prompt", "completion", "digit_parity_reward", "advantage"]
        assert [r[0] for r in table["data"]] == [step] * len(group)
        assert [r[-1] for r in table["data"]] == pytest.approx([row["advantage"] for row in group])
