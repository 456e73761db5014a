"""Tracking: `report_to` is TRL's (trackio, tensorboard, wandb, none); a run with tensorboard writes
event files whose tags include the probe's and the critics' metrics."""

from pathlib import Path

import pytest
from helpers import VARYING_REWARD, assert_saved_weights_moved

from poise_trl.run.recipe import load_recipe, parse_recipe
from poise_trl.run.train import train_from_recipe

REPO = Path(__file__).resolve().parents[1]


def tensorboard_scalars(folder: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(folder.rglob("events.out.tfevents.*"))
    assert events, f"no tensorboard event file under {folder}"
    scalars = {}
    for path in events:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(event.value for event in accumulator.Scalars(tag))
    return scalars


def tiny_recipe(model_dir, algo, **extra):
    return {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "eval_every": 2, "eval_num_samples": 1, "eval_max_new_tokens": 8, "num_generations": 4,
        "per_device_train_batch_size": 8, "max_completion_length": 12, "max_steps": 2, "logging_steps": 1,
        "save_steps": 100, "learning_rate": 1e-3, "seed": 0, "report_to": "tensorboard", "rewards": [VARYING_REWARD],
        **extra,
    }


def test_toy_recipes_report_nowhere_by_default():
    for path in sorted((REPO / "recipes" / "toy").glob("*.yaml")):
        recipe = load_recipe(path)
        assert "report_to" not in recipe, path.name
        assert parse_recipe(recipe).args.report_to in ([], ["none"], "none"), path.name


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "extra", "expected"), [
    ("poise", {"num_generations": 2, "probe_bootstrap_steps": 1, "probe_buffer_rows": 64},
     ["train/probe/variance_reduction", "train/probe/buffer_rows"]),
    ("asyppo", {}, ["train/critic/"]),
])
def test_tensorboard_run_logs_probe_and_critic_metrics(tmp_path, tiny_random_model_dir, algo, extra, expected):
    out = tmp_path / "run"
    train_from_recipe(tiny_recipe(tiny_random_model_dir, algo, **extra), str(out), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, out / "final")
    scalars = tensorboard_scalars(out)
    assert "train/loss" in scalars and len(scalars["train/loss"]) == 2
    for prefix in expected:
        assert any(tag.startswith(prefix) for tag in scalars), (prefix, sorted(scalars))
