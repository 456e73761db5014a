"""kill -9 during `poise train`, at a random step and while a checkpoint is written: rerunning
the same command ends in the same state as a run never interrupted, bit for bit (weights,
held-out curve, generation counters, probe state and report)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import VARYING_REWARD, assert_saved_weights_moved
from safetensors.torch import load_file

from poise_trl.run.recipe import load_recipe
from poise_trl.run.run_folder import CHECKPOINT_MARKER
from poise_trl.run.train import train_from_recipe

MAX_STEPS = 6
RECIPE = {
    "algo": "poise", "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 8, "eval_every": 0,
    "eval_num_samples": 1, "eval_max_new_tokens": 16, "num_generations": 2, "per_device_train_batch_size": 4,
    "max_completion_length": 16, "max_steps": MAX_STEPS, "logging_steps": 1, "save_steps": 1,
    "learning_rate": 1e-3, "seed": 0, "probe_bootstrap_steps": 2, "probe_prompt_components": 2,
    "probe_response_components": 2, "rewards": [VARYING_REWARD],
}


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory, tiny_random_model_dir):
    path = tmp_path_factory.mktemp("fault") / "recipe.yaml"
    recipe = {**RECIPE, "model": str(tiny_random_model_dir)}
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in recipe.items()))
    return path


@pytest.fixture(scope="module")
def uninterrupted(recipe_path, tiny_random_model_dir):
    out = recipe_path.parent / "uninterrupted"
    train_from_recipe(load_recipe(recipe_path), str(out), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")  # else "bit for bit" compares untrained weights
    return out


def start_training(recipe_path, out):
    tests = str(Path(__file__).parent)  # the recipe's reward lives in tests/helpers.py
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "poise_trl.cli.main", "train", str(recipe_path), "-o", str(out), "--no-progress"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(process, condition, timeout=300.0):
    """kill -9 the moment `condition()` holds (polled every millisecond)."""
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "training ended before the kill"
        assert time.time() < deadline, "the kill condition never held"
        time.sleep(0.001)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def assert_same_final_state(out, reference):
    resumed, whole = (json.loads((d / "summary.json").read_text()) for d in (out, reference))
    assert resumed["steps"] == whole["steps"] == MAX_STEPS
    assert resumed["resumed_at_steps"], "the rerun did not resume"
    assert resumed["heldout_history"][-1]["accuracy"] == whole["heldout_history"][-1]["accuracy"]
    assert [p["step"] for p in resumed["heldout_history"]] == [p["step"] for p in whole["heldout_history"]]
    assert (resumed["generated_tokens"], resumed["generated_rollouts"]) == (whole["generated_tokens"],
                                                                          whole["generated_rollouts"])
    assert resumed["wall_clock_seconds"] >= resumed["train_seconds"]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "final weights differ"
    last = f"checkpoint-{MAX_STEPS}"
    for name in ("poise_probe.safetensors", "poise_probe.json", "probe_history.json"):
        assert (out / last / name).read_bytes() == (reference / last / name).read_bytes(), name
    report, whole_report = (json.loads((d / "probe_report.json").read_text()) for d in (out, reference))
    assert report["rounds"] == MAX_STEPS and report["per_round"] == whole_report["per_round"]


@pytest.mark.slow
def test_kill_9_then_rerun_ends_as_if_never_interrupted(recipe_path, uninterrupted, tmp_path):
    """One kill at a random step, either mid-step (after checkpoint-k is complete) or the moment
    checkpoint-k's folder appears (its files being written); then a half-written checkpoint
    after the newest complete one, as a kill during a write leaves it, is always present."""
    out = tmp_path / "run"
    step = random.randint(2, MAX_STEPS - 1)
    mid_write = random.random() < 0.5
    moment = f"{'while checkpoint' if mid_write else 'after checkpoint'}-{step} was written"
    process = start_training(recipe_path, out)
    kill_when(process, (lambda: (out / f"checkpoint-{step}").exists()) if mid_write
              else (lambda: (out / f"checkpoint-{step}" / CHECKPOINT_MARKER).exists()))
    assert not (out / "summary.json").exists(), moment
    newest = max(int(p.parent.name.split("-")[1]) for p in out.glob(f"checkpoint-*/{CHECKPOINT_MARKER}"))
    half = out / f"checkpoint-{newest + 1}"
    if not half.exists():  # the kill landed after the marker: make the half-written one by hand
        shutil.copytree(out / f"checkpoint-{newest}", half)
        (half / CHECKPOINT_MARKER).unlink()
        os.truncate(half / "model.safetensors", 1000)
    lines = []
    train_from_recipe(load_recipe(recipe_path), str(out), show_progress=False, log=lines.append)
    assert f"warning: checkpoint-{newest + 1} is incomplete (interrupted while it was written): skipped" in lines, \
        (moment, lines)
    assert f"resuming from checkpoint-{newest} (step {newest} of {MAX_STEPS})" in lines, (moment, lines)
    assert_same_final_state(out, uninterrupted)


def test_killed_after_the_last_checkpoint_the_rerun_trains_no_extra_step(recipe_path, uninterrupted, tmp_path):
    out = tmp_path / "run"  # as a kill leaves it after checkpoint-MAX_STEPS was marked, before final/ and the summary
    shutil.copytree(uninterrupted, out, ignore=shutil.ignore_patterns("final", "summary.json"))
    process = start_training(recipe_path, out)
    assert process.wait(timeout=300) == 0
    assert not (out / f"checkpoint-{MAX_STEPS + 1}").exists()
    assert_same_final_state(out, uninterrupted)
