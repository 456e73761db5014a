"""Output folders are never silently reused: a finished run is left untouched, another run's
folder is refused, an interrupted one resumes from its newest complete checkpoint."""

import json
import logging
import os
import shutil

import pytest
from helpers import VARYING_REWARD, assert_saved_weights_moved
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.run.recipe import RecipeError, load_recipe
from poise_trl.run.run_folder import (
    CHECKPOINT_MARKER,
    differing_settings,
    inspect_run_folder,
    write_checkpoint_marker,
)
from poise_trl.run.train import train_from_recipe

TINY = {
    "algo": "poise", "dataset": "toy-arith", "dataset_size": 16, "eval_limit": 4, "eval_every": 0,
    "eval_num_samples": 1, "eval_max_new_tokens": 8, "num_generations": 2, "per_device_train_batch_size": 4,
    "max_completion_length": 8, "max_steps": 2, "logging_steps": 1, "save_steps": 1, "learning_rate": 1e-3,
    "seed": 0, "probe_bootstrap_steps": 1, "probe_prompt_components": 2, "probe_response_components": 2,
    "rewards": [VARYING_REWARD],
}


def write_recipe(path, model_dir, **extra):
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in {**TINY, "model": str(model_dir), **extra}.items()))
    return path


def snapshot(folder):
    """Every file under `folder` with its size, modification time and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_random_model_dir):
    """A finished 2-step POISE run on the tiny random model, and the recipe that made it."""
    root = tmp_path_factory.mktemp("finished")
    recipe = write_recipe(root / "recipe.yaml", tiny_random_model_dir)
    train_from_recipe(load_recipe(recipe), str(root / "run"), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, root / "run" / "final")
    return root / "run", recipe


@pytest.mark.slow
def test_a_finished_run_is_reported_and_left_untouched(finished_run, tmp_path):
    run, recipe = finished_run
    before = snapshot(run)
    lines = []
    again = train_from_recipe(load_recipe(recipe), str(run), show_progress=False, log=lines.append)
    assert again["already_finished"] is True and again["steps"] == 2
    assert len(lines) == 1 and "finished (2 steps" in lines[0] and "left untouched" in lines[0]
    # the case: `resume_from_checkpoint=true` on a finished run trained step 3 of 2
    train_from_recipe(load_recipe(recipe, ["resume_from_checkpoint=true"]), str(run), show_progress=False, log=print)
    result = CliRunner().invoke(app, ["train", str(recipe), "-o", str(run), "--no-progress"])
    assert result.exit_code == 0 and result.stderr == ""
    assert len(result.stdout.strip().splitlines()) == 1 and "left untouched" in result.stdout
    with pytest.raises(RecipeError, match=r"other settings \(learning_rate \(0.001 -> 0.01\)\)"):
        train_from_recipe(load_recipe(recipe, ["learning_rate=0.01"]), str(run), show_progress=False)
    assert snapshot(run) == before


@pytest.mark.slow
def test_the_final_folder_holds_our_model_card(finished_run):
    run, _ = finished_run
    card = (run / "final" / "README.md").read_text()
    assert "POISE: 2 rollouts per prompt" in card and "## Held-out accuracy" in card
    assert "## Value probe (POISE)" in card and "2 rounds, the probe active in 1" in card
    assert "num_generations: 2" in card and '"trl": "1.16' in card
    assert "generated_from_trainer" not in card and "fine-tuned version of" not in card
    assert not (run / "README.md").exists()  # TRL's card, written at every save, is switched off


@pytest.mark.slow
def test_overwrite_replaces_the_run_and_nothing_of_it_stays(finished_run, tmp_path, tiny_random_model_dir):
    run = tmp_path / "run"
    shutil.copytree(finished_run[0], run)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_random_model_dir, max_steps=1)
    summary = train_from_recipe(load_recipe(recipe), str(run), show_progress=False, overwrite=True)
    assert summary["steps"] == 1
    assert_saved_weights_moved(tiny_random_model_dir, run / "final")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads((run / "summary.json").read_text())["recipe"]["max_steps"] == 1
    assert not any(p.name.startswith(".run.overwritten") for p in tmp_path.iterdir())


def fake_run(folder, recipe: dict, steps=(1, 2), finished=False):
    """A run folder as `poise train` leaves it, without training: recipe, checkpoints, markers."""
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(json.dumps(recipe))
    for step in steps:
        checkpoint = folder / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "model.safetensors").write_bytes(b"x" * 100)
        write_checkpoint_marker(checkpoint, step)
    if finished:
        (folder / "summary.json").write_text(json.dumps({"recipe": recipe, "steps": steps[-1]}))
    return folder


RECIPE = {"algo": "poise", "max_steps": 6, "peft": {"r": 4}}


def test_folder_states(tmp_path):
    assert inspect_run_folder(tmp_path / "absent", RECIPE).state == "new"
    (tmp_path / "empty").mkdir()
    assert inspect_run_folder(tmp_path / "empty", RECIPE).state == "new"
    folder = inspect_run_folder(fake_run(tmp_path / "cut", RECIPE), RECIPE)
    assert (folder.state, folder.checkpoint.name, folder.step) == ("resume", "checkpoint-2", 2)
    assert inspect_run_folder(fake_run(tmp_path / "done", RECIPE, finished=True), RECIPE).state == "finished"
    # keys that do not change what a run computes may differ
    same_run = {**RECIPE, "resume_from_checkpoint": True, "push_to_hub": True}
    assert inspect_run_folder(tmp_path / "cut", same_run).state == "resume"


def test_a_half_written_checkpoint_is_skipped_with_a_warning(tmp_path):
    run = fake_run(tmp_path / "run", RECIPE, steps=(1, 2, 3))
    (run / "checkpoint-3" / CHECKPOINT_MARKER).unlink()  # killed while checkpoint-3 was written
    folder = inspect_run_folder(run, RECIPE)
    assert folder.checkpoint.name == "checkpoint-2"
    assert folder.warnings == ["checkpoint-3 is incomplete (interrupted while it was written): skipped"]


def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path):
    run = fake_run(tmp_path / "run", RECIPE)
    os.truncate(run / "checkpoint-2" / "model.safetensors", 10)
    with pytest.raises(RecipeError, match=r"checkpoint-2/model.safetensors is truncated or corrupt \(10 bytes, 100"):
        inspect_run_folder(run, RECIPE)


def test_other_settings_are_refused_naming_the_keys(tmp_path):
    run = fake_run(tmp_path / "run", RECIPE)
    with pytest.raises(RecipeError, match=r"other settings \(max_steps \(6 -> 8\), peft.r \(4 -> 8\)\)"):
        inspect_run_folder(run, {**RECIPE, "max_steps": 8, "peft": {"r": 8}})
    assert inspect_run_folder(run, {**RECIPE, "max_steps": 8}, overwrite=True).clear is True
    assert differing_settings({"a": 1, "output_dir": "x"}, {"a": 1, "b": None, "output_dir": "y"}) == []


def test_folders_that_are_not_runs_are_refused_even_with_overwrite(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(RecipeError, match=r"holds files that are not from poise train \(notes.txt\)"):
            inspect_run_folder(tmp_path / "mine", RECIPE, overwrite=overwrite)
    (tmp_path / "file").write_text("")
    with pytest.raises(RecipeError, match="is a file"):
        inspect_run_folder(tmp_path / "file", RECIPE)
    with pytest.raises(RecipeError, match="cannot be created"):
        inspect_run_folder(tmp_path / "file" / "run", RECIPE)


def test_toy_build_keeps_an_existing_model(tmp_path, tiny_random_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_random_model_dir, model)
    before = snapshot(model)
    for command in (["toy", "build", "-o", str(model)], ["toy", "build-critic", "-o", str(model)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and "already holds a model: give --overwrite" in result.stderr
    assert snapshot(model) == before


def test_help_reads_well():
    """No typer placeholders, and every option of every command says what it does."""
    import typer

    group = typer.main.get_command(app)
    commands = [(name, cmd) for name, cmd in group.commands.items() if not hasattr(cmd, "commands")]
    commands += [(f"toy {name}", cmd) for name, cmd in group.commands["toy"].commands.items()]
    for name, command in commands:
        result = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, name
        usage = next(line for line in result.stdout.splitlines() if "Usage:" in line)
        assert "<bool>" not in result.stdout and "{" not in usage, (name, result.stdout)
        missing = [p.name for p in command.params if not getattr(p, "hidden", False) and not (p.help or "").strip()
                   and p.param_type_name == "option"]
        assert not missing, f"poise {name}: options without help: {missing}"


@pytest.mark.slow
def test_killed_after_the_budget_checkpoint_finishes_without_training(tmp_path, tiny_random_model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_random_model_dir, max_steps=100, budget_rollouts=8,
                          budget_eval_points=2)
    run = tmp_path / "run"
    whole = train_from_recipe(load_recipe(recipe), str(run), show_progress=False)
    assert_saved_weights_moved(tiny_random_model_dir, run / "final")
    for name in ("summary.json", "probe_report.json"):  # a kill after the last checkpoint, before the reports
        (run / name).unlink()
    lines = []
    again = train_from_recipe(load_recipe(recipe), str(run), show_progress=False, log=lines.append)
    assert lines == ["resuming from checkpoint-2 (step 2 of 100)"]
    assert (again["steps"], again["generated_rollouts"]) == (2, 8)
    assert again["heldout_history"] == whole["heldout_history"] and again["probe"] == whole["probe"]
    assert json.loads((run / "probe_report.json").read_text())["rounds"] == 2


def test_without_network_hub_names_go_on_offline_and_an_uncached_dataset_fails_at_once(monkeypatch, caplog):
    """No network and no HF_HUB_OFFLINE: one note, then the local cache, as HF_HUB_OFFLINE=1 would; a hub dataset
    that is not in the cache fails at once, naming the fix."""
    import socket

    import datasets

    from poise_trl.run.build import hub_or_offline
    from poise_trl.tasks import load_prompt_dataset
    from poise_trl.tasks.prompts import DatasetUnavailableError

    def no_network(*args, **kwargs):
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    hub_or_offline("toy-arith", "test")  # shipped with the package: no hub needed, nothing changes
    assert not datasets.config.HF_HUB_OFFLINE and not caplog.records
    with caplog.at_level(logging.WARNING, logger="poise_trl.core.loading"):
        hub_or_offline("someone/some-data", None)
    [note] = [record.getMessage() for record in caplog.records]
    assert note.startswith("note: huggingface.co is unreachable: Name or service not known: going on offline")
    assert datasets.config.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(DatasetUnavailableError, match="fetch the data where it is reachable"):
        load_prompt_dataset("someone/some-data")
