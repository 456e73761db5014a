"""The structure the rest relies on: no import circle, evaluation apart from training, one builder,
algorithms that declare themselves, tasks routed by their column, rewards by import path."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_parameters_moved, build_trainer, trainable_parameters

from poise_trl.algorithms import algorithms
from poise_trl.run.recipe import parse_recipe
from poise_trl.seam.trainer import TrainerSeam
from poise_trl.tasks import TaskError, get_family, load_prompt_dataset, score_rows, task_rows
from poise_trl.tasks.rewards import get_reward_functions

PACKAGE = Path(__file__).resolve().parents[1] / "poise_trl"

# The parts of the package, from the top level down (docs/architecture.md); a module belongs to the part with
# the longest prefix of its name. A part imports its own modules and the parts of lower levels, never a part
# above it nor another part of its own level (evaluation and algorithms know nothing of each other).
LEVELS: list[dict[str, tuple[str, ...]]] = [
    {"cli": ("poise_trl.cli",)},
    {"run": ("poise_trl.run",)},
    {"evaluation": ("poise_trl.evaluation",), "algorithms": ("poise_trl.algorithms",)},
    {"seam": ("poise_trl.seam",)},
    {"engines": ("poise_trl.engines",), "probe": ("poise_trl.probe",)},
    {"tasks": ("poise_trl.tasks",)},
    {"core": ("poise_trl.core",)},
]
API = "poise_trl"  # the package's own __init__, the library's API (trainers, configs): above every part


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
        or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))


def loaded_by_name(tree: ast.AST, known: set[str]) -> set[str]:
    """The modules a file loads with `importlib.import_module`: a literal name; or, for a computed one (a
    registry: `FAMILIES[family]`, f"poise_trl.algorithms.{module}"), every module that a string constant of
    the file spells, whole or after the computed name's constant prefix."""
    constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    found = set()
    for call in (n for n in ast.walk(tree) if _is_import_module(n)):
        name = call.args[0] if call.args else None
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.add(name.value)
            continue
        prefix = ""
        if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
            prefix = name.values[0].value
        found |= {prefix + text for text in constants if prefix + text in known}
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every poise_trl module a module imports, at any depth of the file (function-level imports too), or
    loads by name (`loaded_by_name`)."""
    trees = {module_name(path, package): ast.parse(path.read_text()) for path in package.rglob("*.py")
             if "data" not in path.relative_to(package).parts[:1]}
    known = set(trees)
    graph = {}
    for module, tree in trees.items():
        targets = loaded_by_name(tree, known)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("poise_trl"):
                # `from poise_trl import estimators` imports the module estimators, not the package's names
                submodules = {f"{node.module}.{a.name}" for a in node.names} & known
                targets.update(submodules or {node.module})
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("poise_trl"))
        graph[module] = {t for t in targets if t in known and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each holds a circle."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def part_of(module: str) -> tuple[int, str]:
    """(level, part) of a module: the part whose prefix is the longest that its name starts with."""
    if module == API:
        return -1, API
    matches = [(len(prefix), level, part) for level, parts in enumerate(LEVELS)
               for part, prefixes in parts.items() for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")
               or module.startswith(prefix + "_")]
    assert matches, f"{module} belongs to no part of the house: add it to LEVELS"
    _, level, part = max(matches)
    return level, part


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a part above the importer's, or of another part of its own level."""
    wrong = []
    for module, targets in sorted(graph.items()):
        level, part = part_of(module)
        for target in sorted(targets):
            target_level, target_part = part_of(target)
            if target_part != part and target_level <= level:
                wrong.append(f"{module} ({part}) -> {target} ({target_part})")
    return wrong


def test_no_import_circle():
    assert not circles(import_graph()), f"modules on an import circle: {circles(import_graph())}"


def test_every_import_goes_down_the_parts():
    assert not upward_imports(import_graph())


def test_the_house_test_sees_what_importlib_hides(tmp_path):
    """A broken copy of the package: the math datasets reach the task registry again by a computed name (the
    circle tasks -> prompts -> tasks this test once missed), and a core module loads a run module by name."""
    broken = tmp_path / "poise_trl"
    shutil.copytree(PACKAGE, broken, ignore=shutil.ignore_patterns("data", "__pycache__"))
    hidden = {"prompts": 'REGISTRY = "tasks"\n\n\ndef task_rows(name):\n'
                         '    return importlib.import_module(f"poise_trl.{REGISTRY}").task_rows(name)\n',
              "provenance": 'def run_settings():\n'
                            f'    return importlib.import_module("{part_module("recipe")}").RunSettings\n'}
    for stem, code in hidden.items():
        path = next(broken.rglob(f"{stem}.py"))
        path.write_text(f"{path.read_text()}\n\nimport importlib  # noqa: E402\n\n\n{code}")
    graph = import_graph(broken)
    found = circles(graph)
    assert any({part_module("prompts"), "poise_trl.tasks"} <= set(group) for group in found), found
    assert [line for line in upward_imports(graph) if "provenance" in line] == [
        f"{part_module('provenance')} (core) -> {part_module('recipe')} (run)"]
    assert not circles(import_graph()) and not upward_imports(import_graph())  # the real package passes


def test_every_module_of_the_lower_parts_imports_first():
    """Importing a package's module runs the package's __init__ first, which the graph above does not draw:
    a module outside `tasks` that imports `tasks.math_grader` while `tasks` imports it back fails only when
    it is the first one imported. Each module of the tasks and core parts, first, in a fresh interpreter."""
    graph = import_graph()
    lower = sorted(m for m in graph if part_of(m)[1] in ("tasks", "core"))
    script = "import importlib, sys; importlib.import_module(sys.argv[1])"
    for module in lower:
        result = subprocess.run([sys.executable, "-c", script, module], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
        assert result.returncode == 0, f"{module}: {result.stderr.strip().splitlines()[-1:]}"


def part_module(stem: str) -> str:
    """Today's full name of the module file `stem` (poise_trl.run.recipe, later perhaps poise_trl.run.recipe)."""
    return module_name(next(PACKAGE.rglob(f"{stem}.py")), PACKAGE)


def test_evaluation_imports_nothing_from_training():
    graph = import_graph()
    for module in graph:
        if part_of(module)[1] == "evaluation":
            leaks = {m for m in reachable(graph, module) if part_of(m)[1] in ("run", "algorithms", "seam")}
            assert not leaks, f"{module} reaches {sorted(leaks)}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_every_algorithm_declares_itself_and_keeps_the_trainer_contract():
    known = algorithms()
    assert {"grpo", "poise", "asyppo", "ppo", "vapo", "dapo", "rloo", "reinforce_pp", "a2po"} <= known.keys()
    for name, algorithm in known.items():
        assert algorithm.name == name and algorithm.display_name
        assert issubclass(algorithm.trainer_class, TrainerSeam), name
    # the defining settings are the config class's own defaults
    assert parse_recipe({"algo": "poise"}).args.num_generations == 2
    assert parse_recipe({"algo": "vapo", "per_device_train_batch_size": 16}).args.value_warmup_steps == 50
    assert parse_recipe({"algo": "poise", "num_generations": 4}).args.num_generations == 4  # the recipe wins


def test_bundled_model_is_found_from_any_directory(tmp_path):
    script = "from poise_trl.core.loading import resolve_model_path; print(resolve_model_path('data/tiny-qwen3'))"
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
