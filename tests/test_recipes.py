"""Every shipped recipe loads and builds its trainer config (no model, no data needed)."""

from pathlib import Path

import pytest
import torch

from poise_trl.run.recipe import load_recipe, parse_recipe

# recipes/accelerate/ holds launch configs, not recipes (tests/test_plan.py reads them)
RECIPES = sorted(p for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*/*.yaml")
                 if p.parent.name != "accelerate")


def test_there_are_toy_and_gpu_recipes():
    assert {p.parent.name for p in RECIPES} == {"toy", "gpu"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_builds_its_config(path, tmp_path):
    """Every setting a recipe gives its algorithm reaches the trainer's config with the recipe's value: none is
    dropped, renamed or rewritten by the parsing (only bf16, which a CPU cannot run, is turned off here)."""
    parsed = parse_recipe(load_recipe(path), str(tmp_path))
    config = parsed.args
    overridden_here = set() if torch.cuda.is_available() else {"bf16"}
    changed = {key: (value, getattr(config, key)) for key, value in parsed.config_kwargs.items()
               if key not in overridden_here and getattr(config, key) != value}
    assert parsed.config_kwargs and not changed, changed
    if path.parent.name == "gpu":
        assert config.use_vllm and config.vllm_mode == "colocate"
