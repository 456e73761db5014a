"""Recipes: YAML files holding the keys of an algorithm's trainer config plus the run's
model, data, rewards and evaluation settings. Parsing and validation only; `train.py`
builds the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import fnmatch
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from poise_trl.provenance import write_json


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
    # What the recipe needs to fit (`poise plan`): GPUs and the accelerate config to launch with;
    # `poise train` on a GPU checks the plan first unless skip_memory_plan is set.
    gpus: int | None = None
    accelerate_config: str | None = None
    skip_memory_plan: bool = False


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
    check_types(run_kwargs, RunSettings)
    check_types(config_kwargs, config_class)
    check_ranges(recipe)
    return RunSettings(**run_kwargs), config_kwargs


# ---------------------------------------------------------------------------------------
# Value checks: one line naming the key, the value and the fix, before anything runs
# ---------------------------------------------------------------------------------------

ALGO_NAMES = {"poise": "POISE", "poise_process": "POISE", "grpo": "GRPO", "grpo_process": "GRPO", "rloo": "RLOO",
              "rloo_process": "RLOO", "dapo": "DAPO", "asyppo": "AsyPPO", "ppo": "PPO", "vapo": "VAPO",
              "reinforce_pp": "REINFORCE++", "reinforce_pp_baseline": "REINFORCE++ w/ Baseline",
              "a2po": "A*-PO"}


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a dataclass field's annotation; types we do not know pass
    (the config's own __post_init__ still checks them)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, set):
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value) if args else isinstance(
            value, (list, tuple))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {member.value for member in hint}
    return True


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(arg) for arg in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in hint)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
             list: "a list", tuple: "a list", dict: "a mapping"}
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))


# Spellings the code accepts beyond the annotation: `resume_from_checkpoint: true` (the newest
# checkpoint, the Trainer's convention), `rewards: math_accuracy` (one reward).
_ALSO_ALLOWED = {("resume_from_checkpoint", bool), ("rewards", str)}


def check_types(values: dict, dataclass_type: type) -> None:
    """`learning_rate=abc` or `max_steps=ten` fails here, not as a traceback inside TRL."""
    hints = typing.get_type_hints(dataclass_type)
    for key, value in values.items():
        if (key, type(value)) in _ALSO_ALLOWED:
            continue
        if value is not None and key in hints and not _matches(value, hints[key]):
            raise RecipeError(f"{key}: {value!r} is not {_describe(hints[key])}: give {key} as {_describe(hints[key])}")


# key -> (lowest allowed, highest allowed, whether the lowest is excluded)
_RANGES: dict[str, tuple[float, float, bool]] = {
    **dict.fromkeys(("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
                     "max_prompt_length", "num_iterations", "steps_per_generation", "generation_batch_size",
                     "logging_steps", "save_steps", "save_total_limit", "eval_num_samples", "eval_max_new_tokens",
                     "eval_batch_size", "dataset_size", "eval_limit", "budget_tokens", "budget_rollouts",
                     "budget_eval_points", "num_generations", "probe_buffer_rows", "probe_prompt_components",
                     "probe_response_components", "num_train_epochs"), (0, math.inf, True)),
    **dict.fromkeys(("learning_rate", "temperature", "repetition_penalty"), (0, math.inf, True)),
    **dict.fromkeys(("eval_every", "warmup_steps", "beta", "epsilon", "epsilon_high", "weight_decay", "max_grad_norm",
                     "probe_bootstrap_steps", "probe_ridge_alpha", "eval_temperature", "seed", "data_seed"),
                    (0, math.inf, False)),
    **dict.fromkeys(("top_p", "min_p", "warmup_ratio", "adam_beta1", "adam_beta2", "peft.lora_dropout"), (0, 1, False)),
    "peft.r": (0, math.inf, True),
}


def _range_error(key: str, value: Any, low: float, high: float, open_low: bool) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value is None:
        return None
    if (value <= low if open_low else value < low) or value > high:
        if high == 1 and low == 0:
            wanted = "a probability in [0, 1]"
        else:
            wanted = f"{'>' if open_low else '>='} {low:g}" + ("" if high == math.inf else f" and <= {high:g}")
        return f"{key}: {value!r} is out of range: give {key} {wanted}"
    return None


def check_ranges(recipe: dict) -> None:
    """Ranges and the rules that depend on the algorithm, e.g. `max_steps=0` (TRL trains one
    step) or `max_steps=-5` (TRL trains 3 epochs), POISE with one rollout per prompt."""
    flat = dict(recipe)
    flat.update({f"peft.{k}": v for k, v in (recipe.get("peft") or {}).items()} if isinstance(recipe.get("peft"), dict)
                else {})
    for key, (low, high, open_low) in _RANGES.items():
        if flat.get(key) is not None and (problem := _range_error(key, flat[key], low, high, open_low)):
            raise RecipeError(problem)
    max_steps = recipe.get("max_steps")
    by_epochs = max_steps == -1 and recipe.get("num_train_epochs") is not None
    if isinstance(max_steps, int) and max_steps < 1 and not by_epochs:
        raise RecipeError(f"max_steps: {max_steps} is not a number of steps: give max_steps >= 1 (or max_steps: -1 "
                          "with num_train_epochs: N to train by epochs)")
    algo = recipe.get("algo", "grpo")
    generations = recipe.get("num_generations")
    if isinstance(generations, int) and generations < 2 and algo != "reinforce_pp":
        name = ALGO_NAMES.get(algo, algo)
        why = ("each rollout's baseline comes from another rollout of the same prompt" if name == "POISE"
               else "its baseline comes from the other rollouts of the same prompt")
        fix = "num_generations: 2" if name == "POISE" else "num_generations >= 2 (or algo: reinforce_pp for one)"
        raise RecipeError(f"num_generations: {generations}: {name} needs at least 2 rollouts per prompt ({why}); "
                          f"set {fix}")


# ---------------------------------------------------------------------------------------
# Output folders: decided before anything is written
# ---------------------------------------------------------------------------------------

CHECKPOINT_MARKER = "checkpoint_complete.json"  # written last into a checkpoint: its presence means complete
# Keys that do not change what a run computes: a rerun may differ in them and still be the same run.
NOT_SETTINGS = {"resume_from_checkpoint", "push_to_hub", "hub_model_id", "output_dir"}
# What `poise train` writes into an output folder; --overwrite removes nothing else.
RUN_ENTRIES = ("recipe.yaml", "summary.json", "probe_report.json", "probe_values.png", "README.md", "final",
               "checkpoint-*", "*.tmp")


def _flatten(recipe: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in recipe.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differing_settings(recorded: dict, wanted: dict) -> list[str]:
    """Recipe keys (dotted for nested ones, e.g. peft.r) whose values differ between the
    recipe a run folder was made with and the one asked for now."""
    old, new = _flatten(recorded), _flatten(wanted)
    return sorted(k for k in old.keys() | new.keys() if k.split(".")[0] not in NOT_SETTINGS and old.get(k) != new.get(k))


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def checkpoint_problem(folder: Path) -> str | None:
    """None for a complete checkpoint; otherwise what is wrong with it. The marker lists every
    file with its size, so a file truncated or replaced after the write is caught too."""
    marker = folder / CHECKPOINT_MARKER
    if not marker.is_file():
        return "incomplete"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{marker} is unreadable"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is truncated or corrupt ({path.stat().st_size} bytes, {size} when it was written)"
    return None


def write_checkpoint_marker(folder: Path, step: int) -> None:
    """Call after everything else of the checkpoint is written (write then rename)."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MARKER and not p.name.endswith(".tmp")}
    write_json(folder / CHECKPOINT_MARKER, {"step": step, "files": files})


@dataclass
class RunFolder:
    """What an output folder holds, and what `poise train` does with it: "new" (start at step
    0), "resume" (from `checkpoint`) or "finished" (report `summary`, touch nothing)."""

    path: Path
    state: str
    checkpoint: Path | None = None
    summary: dict | None = None
    warnings: list[str] = field(default_factory=list)
    clear: bool = False  # --overwrite: the old run's files go before the new run writes

    @property
    def step(self) -> int | None:
        return checkpoint_step(self.checkpoint) if self.checkpoint else None


def check_output_dir(path: Path) -> None:
    """A file, or a folder that cannot be created or written, fails before anything runs."""
    if path.exists() and not path.is_dir():
        raise RecipeError(f"output folder {path} is a file: give a folder path with --output-dir")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RecipeError(f"output folder {path} cannot be created: {existing} is a file. Give another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"output folder {path} is not writable (no write permission on {existing}): give another "
                          "--output-dir")


def _foreign_entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in RUN_ENTRIES))


def inspect_run_folder(path: str | Path, recipe: dict, overwrite: bool = False, explicit: str | None = None) -> RunFolder:
    """Decide what to do with an output folder, reading only. A folder holding another run
    (different settings) or files that are not a run is refused; `overwrite` lets the new run
    replace the old one (never foreign files). `explicit` is a checkpoint folder the user named."""
    path = Path(path)
    check_output_dir(path)
    if not path.exists() or not any(path.iterdir()):
        return RunFolder(path, "new")
    foreign = _foreign_entries(path)
    if foreign:
        raise RecipeError(f"output folder {path} holds files that are not from poise train ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): give an empty or new --output-dir")
    summary_path, recipe_path = path / "summary.json", path / "recipe.yaml"
    summary = None
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except ValueError:
            raise RecipeError(f"{summary_path} is unreadable (truncated?): move it away to resume the run, or give "
                              "--overwrite to start over") from None
    if recipe_path.exists():
        try:
            recorded = read_yaml(recipe_path.read_text()) or {}
        except yaml.YAMLError:
            raise RecipeError(f"{recipe_path} is unreadable (truncated?): give --overwrite to start over, or another "
                              "--output-dir") from None
    elif summary is not None:
        recorded = summary.get("recipe", {})
    else:
        raise RecipeError(f"output folder {path} holds run files but no recipe.yaml, so its settings are unknown: "
                          "give --overwrite to start over, or another --output-dir")
    if overwrite:
        return RunFolder(path, "new", clear=True)
    differing = differing_settings(recorded, recipe)
    if differing:
        shown = ", ".join(f"{k} ({_flatten(recorded).get(k)!r} -> {_flatten(recipe).get(k)!r})" for k in differing[:4])
        raise RecipeError(f"output folder {path} holds a run made with other settings ({shown}"
                          f"{', ...' if len(differing) > 4 else ''}): give another --output-dir, or --overwrite to "
                          "replace that run")
    if summary is not None:
        return RunFolder(path, "finished", summary=summary)
    if explicit is not None:
        return RunFolder(path, "resume", checkpoint=Path(explicit))
    folder = RunFolder(path, "new")
    checkpoints = sorted((p for p in path.glob("checkpoint-*") if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit()),
                         key=checkpoint_step, reverse=True)
    for checkpoint in checkpoints:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            folder.state, folder.checkpoint = "resume", checkpoint
            break
        if problem != "incomplete":
            raise RecipeError(f"checkpoint {checkpoint.name} is damaged: {problem}. Delete {checkpoint} to resume from "
                              "the checkpoint before it, or give --overwrite to start over")
        folder.warnings.append(f"{checkpoint.name} is incomplete (interrupted while it was written): skipped")
    return folder


MODEL_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "adapter_config.json")


def check_model_files(folder: str | Path) -> None:
    """A truncated or corrupt weights, config or tokenizer file in a local model folder (or a
    checkpoint) gives one line naming it, before any of it is loaded. Reads only the
    safetensors headers and the small JSON files, so it costs milliseconds on a 4B model."""
    folder = Path(folder)
    if not folder.is_dir():
        return  # a hub id: transformers resolves and checks it
    for name in MODEL_JSON_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError):
                raise RecipeError(f"{path} is not valid JSON (truncated or corrupt): restore or rebuild that file") from None
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")) and (folder / "config.json").is_file():
        raise RecipeError(f"model folder {folder} has a config.json but no weights (*.safetensors): copy the weights "
                          "into it, or give another model")
    from safetensors import safe_open

    for path in weights:
        try:
            with safe_open(str(path), "pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error type for every kind of damage
            raise RecipeError(f"{path} is truncated or corrupt ({exc}): restore or rebuild that file") from None
