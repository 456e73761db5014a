"""Every shipped recipe loads and builds its trainer config (no model, no data needed)."""

from pathlib import Path

import pytest

from poise_trl.build import parse_recipe
from poise_trl.recipe import load_recipe

# recipes/accelerate/ holds launch configs, not recipes (tests/test_plan.py reads them)
RECIPES = sorted(p for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*/*.yaml") if p.parent.name != "accelerate")


def test_there_are_toy_and_gpu_recipes():
    assert {p.parent.name for p in RECIPES} == {"toy", "gpu"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_builds_its_config(path, tmp_path):
    recipe = load_recipe(path)
    config = parse_recipe(recipe, str(tmp_path)).args
    assert getattr(config, "num_generations", 1) >= 1 and config.seed == recipe.get("seed", config.seed)
    if path.parent.name == "gpu":
        assert config.use_vllm and config.vllm_mode == "colocate"
