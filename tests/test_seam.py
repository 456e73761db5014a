"""One seam to TRL: no poise-trl file outside `poise_trl/seam/` defines or touches a private name of TRL's or
transformers' classes (the trainers, the vLLM generation and client); every algorithm trains through the seam."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import trl
from helpers import build_trainer
from packaging.version import Version

from poise_trl.run.recipe import RecipeError

PACKAGE = Path(__file__).resolve().parents[1] / "poise_trl"
SEAM = PACKAGE / "seam"


def trl_private_names() -> set[str]:
    """Private methods and attributes of the TRL and transformers classes poise-trl builds on: every `_name`
    their classes define, and every `self._name` their source assigns or reads."""
    from trl import GRPOTrainer
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.import_utils import suppress_experimental_warning

    with suppress_experimental_warning():
        from trl.experimental.a2po import A2POTrainer

    classes = [GRPOTrainer, A2POTrainer, VLLMGeneration, VLLMClient]
    try:  # TRL 1.16's experimental asynchronous trainer (seam/async_grpo.py); TRL 1.14 has another
        from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

        classes += [AsyncGRPOTrainer, AsyncRolloutWorker, _AsyncRolloutLoop]
    except ImportError:
        pass
    names = set()
    for cls in classes:
        for klass in cls.__mro__[:-1]:  # without `object`
            names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
            names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)", inspect.getsource(klass)))
    return names


def private_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each definition of a method named in `names` inside a class, and each attribute access
    `x._name` with `_name` in `names`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, f"uses {node.attr}"))
        if isinstance(node, ast.ClassDef):
            found += [(item.lineno, f"defines {item.name}") for item in node.body
                      if isinstance(item, ast.FunctionDef) and item.name in names]
    return found


def test_no_private_trl_name_outside_the_seam():
    names = trl_private_names()
    assert {"_generate_and_score_completions", "_compute_loss", "_metrics", "_save_checkpoint"} <= names
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                 for path in sorted(PACKAGE.rglob("*.py")) if SEAM not in path.parents
                 for line, what in private_uses(path.read_text(), names)]
    assert not offenders, "\n".join(offenders)


def test_the_check_finds_an_override_and_a_call():
    source = ("class T(GRPOTrainer):\n"
              "    def _compute_loss(self, model, inputs):\n"
              "        self._metrics['train']['x'].append(1)\n"
              "        return super()._compute_loss(model, inputs)\n")
    found = sorted(private_uses(source, trl_private_names()))
    assert found == [(2, "defines _compute_loss"), (3, "uses _metrics"), (4, "uses _compute_loss")]


@pytest.mark.parametrize("module", sorted(p.stem for p in SEAM.glob("*.py") if p.stem != "__init__"))
def test_every_seam_module_is_documented(module):
    """docs/trl.md lists what each seam module touches."""
    assert f"seam/{module}.py" in (PACKAGE.parent / "docs" / "trl.md").read_text()


def test_outcome_advantages_by_name(tmp_path, tiny_random_model_dir):
    """`advantage:` picks the pure function of core/estimators.py; a wrong name is one line before any model loads."""
    from helpers import build_trainer

    from poise_trl.core import estimators
    from poise_trl.run.recipe import parse_recipe

    recipe = {"algo": "grpo", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 8,
              "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4, "max_steps": 1}
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    for name, function in estimators.OUTCOME_ADVANTAGES.items():
        trainer = build_trainer({**recipe, "advantage": name}, tmp_path / name)
        torch.testing.assert_close(trainer.compute_advantages(rewards, {}), function(rewards, 2))
    assert build_trainer(recipe, tmp_path / "trl").compute_advantages(rewards, {}) is None  # TRL's own
    with pytest.raises(ValueError, match="advantage must be one of grpo, group_mean, rloo"):
        parse_recipe({**recipe, "advantage": "rlo"})
    with pytest.raises(ValueError, match="unknown recipe key 'advantage' for algo 'poise'"):
        parse_recipe({**recipe, "algo": "poise", "advantage": "rloo"})


@pytest.mark.skipif(Version(trl.__version__) >= Version("1.16"), reason="TRL 1.16 has the asynchronous trainer")
def test_async_on_an_older_trl_is_one_line(tiny_random_model_dir, tmp_path):
    recipe = {"algo": "poise", "async": True, "model": str(tiny_random_model_dir), "dataset": "toy-arith",
              "dataset_size": 16, "per_device_train_batch_size": 8, "max_completion_length": 8, "eval_every": 0,
              "beta": 0.0, "vllm_server_base_url": "http://127.0.0.1:9", "seed": 0}
    with pytest.raises(RecipeError, match="async: true needs TRL 1.16") as error:
        build_trainer(recipe, tmp_path)
    assert "\n" not in str(error.value)
