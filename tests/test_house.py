"""The structure the rest relies on: no import circle, evaluation apart from training, one builder,
algorithms that declare themselves, tasks routed by their column, rewards by import path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_parameters_moved, build_trainer, trainable_parameters

from poise_trl.build import parse_recipe
from poise_trl.prompts import load_prompt_dataset
from poise_trl.rewards import get_reward_functions
from poise_trl.tasks import TaskError, get_family, score_rows, task_rows
from poise_trl.trainers import algorithms
from poise_trl.trainers.base import TrainerContract

PACKAGE = Path(__file__).resolve().parents[1] / "poise_trl"
EVALUATION = ("poise_trl.bench", "poise_trl.bench_data", "poise_trl.bench_scores", "poise_trl.bench_reports",
              "poise_trl.probe_eval", "poise_trl.grade", "poise_trl.value_model", "poise_trl.plots", "poise_trl.generation",
              "poise_trl.metrics", "poise_trl.progress")
TRAINING = ("poise_trl.train", "poise_trl.build", "poise_trl.trainers", "poise_trl.callbacks")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every poise_trl import of every module, at any depth of the file (function-level imports too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if "data" in path.relative_to(PACKAGE).parts[:1]:
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("poise_trl"):
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("poise_trl"))
        graph[module_name(path)] = targets
    return {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_no_import_circle():
    graph = import_graph()
    # a package imports its own modules (trainers/__init__ loads the registered ones): not a circle
    circles = [m for m in graph if m in reachable({k: {t for t in v if not t.startswith(k + ".")}
                                                    for k, v in graph.items()}, m)]
    assert not circles, f"modules on an import circle: {sorted(circles)}"


def test_evaluation_imports_nothing_from_training():
    graph = import_graph()
    for module in EVALUATION:
        leaks = {m for m in reachable(graph, module) if m.startswith(TRAINING)}
        assert not leaks, f"{module} reaches {sorted(leaks)}"


def test_every_algorithm_declares_itself_and_keeps_the_trainer_contract():
    known = algorithms()
    assert {"grpo", "poise", "asyppo", "ppo", "vapo", "dapo", "rloo", "reinforce_pp", "a2po"} <= known.keys()
    for name, algorithm in known.items():
        assert algorithm.name == name and algorithm.display_name
        assert issubclass(algorithm.trainer_class, TrainerContract), name
    # the defining settings are the config class's own defaults
    assert parse_recipe({"algo": "poise"}).args.num_generations == 2
    assert parse_recipe({"algo": "vapo", "per_device_train_batch_size": 16}).args.value_warmup_steps == 50
    assert parse_recipe({"algo": "poise", "num_generations": 4}).args.num_generations == 4  # the recipe wins


def test_bundled_model_is_found_from_any_directory(tmp_path):
    script = "from poise_trl.loading import resolve_model_path; print(resolve_model_path('data/tiny-qwen3'))"
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}).stdout.strip()
    assert Path(out, "config.json").is_file()


def test_user_reward_functions_by_import_path():
    funcs = get_reward_functions(["math_accuracy", "fixtures.user_rewards:length_penalty"])
    assert funcs[1](["abcd", "ab"]) == pytest.approx([-0.04, -0.02])
    with pytest.raises(ValueError, match="cannot import 'fixtures.nowhere'"):
        get_reward_functions(["fixtures.nowhere:f"])
    with pytest.raises(ValueError, match="has no 'missing'"):
        get_reward_functions(["fixtures.user_rewards:missing"])
    with pytest.raises(ValueError, match="is not callable"):
        get_reward_functions(["fixtures.user_rewards:NOT_CALLABLE"])


def test_a_task_dataset_carries_its_verifier_and_the_task_reward_routes_each_row():
    rows = load_prompt_dataset("reasoning-gym:chain_sum", limit=6, seed=3,
                               task_config={"min_terms": 2, "max_terms": 2, "max_digits": 1})
    assert set(rows.column_names) >= {"prompt", "answer", "task", "verifier"} and len(rows) == 6
    right = [f"<think>x</think><answer>{answer}</answer>" for answer in rows["answer"]]
    wrong = ["<think>x</think><answer>nope</answer>"] * len(rows)
    assert score_rows(right, rows["task"], rows["verifier"]) == [1.0] * 6
    assert score_rows(wrong, rows["task"], rows["verifier"]) == [0.0] * 6
    assert parse_recipe({"algo": "grpo", "dataset": "reasoning-gym:chain_sum"}).settings.rewards == ["task"]
    with pytest.raises(TaskError, match="unknown task 'reasoning-gymm:chain_sum'; did you mean 'reasoning-gym'"):
        get_family("reasoning-gymm:chain_sum")
    with pytest.raises(TaskError, match=r"unknown task_config key 'timout_s' .*did you mean 'timeout_s'.*allowed: "
                                        r"code_sandbox, timeout_s"):
        task_rows("humaneval", "train", 2, 0, {"timout_s": 3})


@pytest.mark.slow
def test_a_trainer_from_the_builder_trains_and_its_weights_move(tmp_path, tiny_random_model_dir):
    trainer = build_trainer({"algo": "poise", "model": str(tiny_random_model_dir), "dataset": "toy-arith",
                             "dataset_size": 32, "eval_limit": 2, "per_device_train_batch_size": 8,
                             "max_completion_length": 12, "max_steps": 2, "save_strategy": "no",
                             "learning_rate": 1e-2, "seed": 0,
                             "rewards": ["fixtures.user_rewards:length_penalty"]}, tmp_path / "run")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
