"""The multitask tiny world: data/tiny-qwen3-multitask (the toy-arith model taught three reasoning-gym tasks
besides, toy-arith kept as the task math:toy-arith), its recipes, and the command that builds it."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, assert_parameters_moved, build_trainer, trainable_parameters
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.core.loading import BUNDLED_DATA
from poise_trl.run.recipe import load_recipe, parse_recipe
from poise_trl.run.toy import MULTITASK_TASKS, build_multitask_model, multitask_mix

MODEL_DIR = BUNDLED_DATA / "tiny-qwen3-multitask"
RECIPES = {name: f"recipes/toy/{name}_multitask.yaml"
           for name in ("poise", "poise_shared", "grpo", "grpo_2", "rloo_2", "dapo")}


@pytest.fixture(scope="module")
def build_info() -> dict:
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip("the multitask model is not built (poise toy build --world multitask)")
    return json.loads((MODEL_DIR / "build_info.json").read_text())


def test_the_multitask_model_loads_and_spells_its_tasks_questions(build_info):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poise_trl.tasks import task_rows

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) == build_info["parameters"]
    for entry in multitask_mix():
        row = task_rows(entry["name"], "test", 4, 0, entry.get("config"))[0]
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids, entry["name"]
        assert len(ids) + 96 <= model.config.max_position_embeddings  # prompt and the longest completion fit


def test_every_task_starts_with_room_for_rl(build_info):
    """Held-out sampled accuracy, as the build measured it, inside [0.15, 0.85] on each task: every task of
    an RL run on the mix has rollouts that succeed and rollouts that fail."""
    by_task = build_info["heldout_sampled_accuracy"]["by_task"]
    assert set(by_task) == set(MULTITASK_TASKS)
    outside = {task: value for task, value in by_task.items() if not 0.15 <= value <= 0.85}
    assert not outside, outside
    assert build_info["tasks"] == multitask_mix()  # the card describes the tasks the recipes name


def test_the_multitask_recipes_parse_and_generate_as_many_completions_per_step():
    recipes = {name: load_recipe(path) for name, path in RECIPES.items()}
    parsed = {name: parse_recipe(recipe) for name, recipe in recipes.items()}
    for name, recipe in recipes.items():
        assert recipe["dataset"] == multitask_mix(), name
        assert recipe["model"] == "data/tiny-qwen3-multitask"
        assert parsed[name].settings.rewards == ["task"]
    args = {name: p.args for name, p in parsed.items()}
    assert {a.per_device_train_batch_size for a in args.values()} == {64}
    assert {name: a.num_generations for name, a in args.items()} == {
        "poise": 2, "poise_shared": 2, "grpo": 8, "grpo_2": 2, "rloo_2": 2, "dapo": 8}
    assert {a.learning_rate for a in args.values()} == {5e-5}
    assert args["poise"].probe_domain_column == "task"  # one value probe per task
    assert args["poise_shared"].probe_domain_column is None  # one probe for all tasks


@pytest.mark.slow
def test_poise_multitask_trains_and_logs_every_tasks_reward(tmp_path, build_info):
    # the recipe as `poise train recipes/toy/poise_multitask.yaml max_steps=2` reads it, held-out set cut short
    recipe = load_recipe(RECIPES["poise"], ["max_steps=2", "logging_steps=1", "eval_limit=10",
                                            "eval_num_samples=1", "eval_max_new_tokens=8"])
    trainer = build_trainer(recipe, tmp_path / "run")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {f"rewards/task/{task}/mean" for task in MULTITASK_TASKS} <= logged


@pytest.mark.slow
def test_the_multitask_build_runs_end_to_end(tmp_path, bundled_model_dir):
    """The build command's whole path (data, SFT, per-task evaluation, files, card) in a few steps."""
    card = build_multitask_model(tmp_path, max_steps=2, batch_size=8, eval_samples=1, eval_rows=4, progress=False)
    assert set(card["heldout_sampled_accuracy"]["by_task"]) == set(MULTITASK_TASKS)
    assert json.loads((tmp_path / "build_info.json").read_text())["sft"]["max_steps"] == 2
    assert {"model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in tmp_path.iterdir()}
    assert "reasoning-gym:gcd" in (tmp_path / "README.md").read_text()
    with pytest.raises(ValueError, match="already holds a model"):
        build_multitask_model(tmp_path, max_steps=2)


def test_an_unknown_world_is_one_line():
    result = CliRunner().invoke(app, ["toy", "build", "--world", "multitsak"], env={"COLUMNS": "1000"})
    assert_one_line_error(result, result.output, "unknown --world 'multitsak'; give one of toy-arith, multitask")
