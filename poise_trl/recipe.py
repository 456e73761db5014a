"""Recipes: YAML files holding the keys of an algorithm's trainer config plus the run's
model, data, rewards and evaluation settings. Parsing and validation only; `train.py`
builds the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class _RecipeLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-6` as a string; recipes are full of such learning rates."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(text: str):
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass


class RecipeError(ValueError):
    """A recipe or an override the user must fix; the message says how."""


@dataclass
class RunSettings:
    """The recipe keys that are not trainer-config fields."""

    algo: str = "grpo"
    model: str = "data/tiny-qwen3"
    dataset: str = "toy-arith"
    dataset_split: str | None = None
    dataset_columns: dict[str, str] | None = None
    dataset_size: int | None = None
    eval_dataset: str | None = None
    eval_split: str | None = None
    eval_limit: int | None = None
    prompt_suffix: str | None = None
    system_prompt: str | None = None
    rewards: list[str] = field(default_factory=lambda: ["math_accuracy"])
    peft: dict[str, Any] | None = None
    eval_every: int = 10
    eval_num_samples: int = 4
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 256
    eval_batch_size: int = 128
    push_to_hub: bool = False  # push the final model and its card once training ends (not TRL's per-save push)
    # A generation budget (`poise compare` sets one): stop once this many completion tokens, or
    # rollouts, were generated for training, evaluating at `budget_eval_points` equal fractions
    # of it. max_steps still caps the run.
    budget_tokens: int | None = None
    budget_rollouts: int | None = None
    budget_eval_points: int = 4


RUN_KEYS = {f.name for f in dataclasses.fields(RunSettings)}


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value read as YAML (`lr=1e-5`, `peft.r=8`, `rewards=[a,b]`)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} is not of the form key=value (e.g. max_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(f"override {text!r} has an empty key")
    try:
        value = read_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: cannot read the value as YAML ({exc})") from None
    return key, value


def apply_override(recipe: dict, key: str, value: Any) -> None:
    node = recipe
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {key}: {part!r} is not a mapping in the recipe")
    node[leaf] = value


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} not found (recipes live in recipes/, e.g. recipes/toy/grpo.yaml)")
    try:
        recipe = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {path} must be a mapping of keys to values, got {type(recipe).__name__}")
    for text in overrides or []:
        apply_override(recipe, *parse_override(text))
    return recipe


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def split_recipe(recipe: dict, config_class: type) -> tuple[RunSettings, dict]:
    """Separate run settings from trainer-config kwargs, rejecting unknown keys with a suggestion."""
    config_keys = {f.name for f in dataclasses.fields(config_class) if f.init}
    run_kwargs, config_kwargs = {}, {}
    for key, value in recipe.items():
        if key in RUN_KEYS:
            run_kwargs[key] = value
        elif key in config_keys:
            config_kwargs[key] = value
        else:
            raise RecipeError(
                f"unknown recipe key {key!r} for algo {recipe.get('algo', 'grpo')!r}{_suggest(key, RUN_KEYS | config_keys)} "
                f"(valid keys: the run settings {sorted(RUN_KEYS)} and the fields of {config_class.__name__})"
            )
    return RunSettings(**run_kwargs), config_kwargs
