"""Recipes: YAML files holding the keys of an algorithm's trainer config plus the run's model, data,
rewards and evaluation settings, parsed once into a `RunPlan` that `plan`, `build` and `train` read.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from poise_trl.core.loading import PACKAGE_ROOT, RecipeError
from poise_trl.engines.tool_worker import DEFAULT_TOOL_RESULT_TOKENS, DEFAULT_TOOL_TIMEOUT_S, DEFAULT_TOOL_TURNS

if TYPE_CHECKING:
    from poise_trl.algorithms.base import Algorithm



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


@dataclass
class RunSettings:
    """The recipe keys that are not trainer-config fields."""

    algo: str = "grpo"
    model: str = "data/tiny-qwen3"
    # A name, file or hub id; or a task mix: a list of task names or {name, weight, size, seed, config}
    # entries (poise_trl.tasks.mix_rows).
    dataset: str | list[str | dict[str, Any]] = "toy-arith"
    dataset_split: str | None = None
    dataset_columns: dict[str, str] | None = None
    dataset_size: int | None = None
    eval_dataset: str | None = None
    eval_split: str | None = None
    eval_limit: int | None = None
    prompt_suffix: str | None = None
    system_prompt: str | None = None
    task_config: dict[str, Any] | None = None  # the task family's own keys when `dataset` names a task
    rewards: list[str] | None = None  # None: `task` for a task dataset, else `math_accuracy`
    # TRL's rollout modes beyond one turn, each by import path `module:name` (docs/recipes.md, tools):
    tools: list[str] | None = None  # functions the model may call during its rollout
    environment: str | None = None  # a class: one instance per rollout, its public methods the tools
    rollout_func: str | None = None  # rollout_func(prompts, trainer) -> dict: builds the completions itself
    # Limits of tools and environments (engines/tools.py); the turn limit is max_tool_calling_iterations (8 here).
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT_S  # seconds a call may run before its process is killed
    tool_result_tokens: int = DEFAULT_TOOL_RESULT_TOKENS  # a longer result is cut
    peft: dict[str, Any] | None = None
    # `async: true`: TRL's AsyncGRPOTrainer against a vLLM server (vllm_server_base_url, else one `poise train`
    # starts), training on rollouts at most `max_staleness` policy versions old (seam/async_grpo.py).
    asynchronous: bool = False
    max_staleness: int = 1
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


DEFAULT_COLLECTIVE_TIMEOUT_S = 600

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


# The shipped recipes: package data (a source checkout links them as recipes/).
BUNDLED_RECIPES = PACKAGE_ROOT / "recipes"


def bundled_recipes() -> dict[str, Path]:
    """Every shipped recipe by name: its path under recipes/ without `.yaml` (`toy/poise`)."""
    return {path.relative_to(BUNDLED_RECIPES).with_suffix("").as_posix(): path
            for path in sorted(BUNDLED_RECIPES.rglob("*.yaml"))}


def find_bundled_recipe(name: str) -> Path:
    """A shipped recipe by name (`toy/poise`), by a name unique among the files (`poise`), or by its path in
    the repository (`recipes/toy/poise.yaml`, so the docs' commands run from any folder of an install)."""
    shipped = bundled_recipes()
    key = name.removeprefix("recipes/").removesuffix(".yaml")
    by_file = {}
    for full in shipped:
        by_file.setdefault(full.rpartition("/")[2], []).append(full)
    if key in shipped or len(by_file.get(key, [])) == 1:
        return shipped[key if key in shipped else by_file[key][0]]
    close = difflib.get_close_matches(key, list(shipped) + list(by_file), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise RecipeError(f"recipe {name!r} not found: it is neither a file nor a shipped recipe; {hint}`poise recipes "
                      "ls` lists the shipped ones")


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict:
    path = Path(path)
    if not path.is_file():
        path = find_bundled_recipe(str(path))
    try:
        recipe = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {path} must be a mapping of keys to values, got {type(recipe).__name__}")
    for text in overrides or []:
        apply_override(recipe, *parse_override(text))
    # what needs no algorithm, checked before torch and TRL load (`parse_recipe` checks the rest)
    check_types({key: value for key, value in recipe.items() if key in RUN_KEYS}, RunSettings)
    check_ranges(recipe)
    return recipe


def recipe_tools(path: str | Path) -> dict:
    """`tool_limits` of the recipe at `path`, refused in one line when it has no tools to evaluate with."""
    recipe = load_recipe(path)
    if not recipe.get("tools") and not recipe.get("environment"):
        raise RecipeError(f"recipe {path} has no tools and no environment to evaluate with: give one that has "
                          "(tools: [module:function] or environment: module:Class)")
    return tool_limits(recipe)


def tool_limits(recipe: dict) -> dict:
    """A recipe's tools, environment and their limits, as the evaluation tools run them
    (`evaluation.agent.RecipeTools`): `poise bench --tools-from` and a run's held-out evaluation."""
    tools = recipe.get("tools") or ()
    return {"tools": (tools,) if isinstance(tools, str) else tuple(tools), "environment": recipe.get("environment"),
            "max_turns": recipe.get("max_tool_calling_iterations") or DEFAULT_TOOL_TURNS,
            "result_tokens": recipe.get("tool_result_tokens", RunSettings.tool_result_tokens),
            "timeout_s": recipe.get("tool_timeout", RunSettings.tool_timeout)}


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def split_recipe(recipe: dict, algorithm) -> tuple[RunSettings, dict]:
    """Separate run settings from trainer-config kwargs of `algorithm` (a registered
    `trainers.base.Algorithm`), rejecting unknown keys with a suggestion and bad values with one line."""
    config_class = algorithm.config_class
    config_keys = {f.name for f in dataclasses.fields(config_class) if f.init}
    run_kwargs, config_kwargs = {}, {}
    for key, value in recipe.items():
        key = "asynchronous" if key == "async" else key  # `async` is a Python keyword
        if key in RUN_KEYS:
            run_kwargs[key] = value
        elif key in config_keys:
            config_kwargs[key] = value
        else:
            hint = _suggest(key, RUN_KEYS | config_keys)
            raise RecipeError(
                f"unknown recipe key {key!r} for algo {recipe.get('algo', 'grpo')!r}{hint} (valid keys: the run "
                f"settings {sorted(RUN_KEYS)} and the fields of {config_class.__name__})"
            )
    check_types(run_kwargs, RunSettings)
    check_types(config_kwargs, config_class)
    check_ranges(recipe, algorithm)
    return RunSettings(**run_kwargs), config_kwargs


# --- Value checks: one line naming the key, the value and the fix, before anything runs ---

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
# checkpoint, the Trainer's convention), `rewards: math_accuracy` (one reward), `tools: my_tools:add` (one tool).
_ALSO_ALLOWED = {("resume_from_checkpoint", bool), ("rewards", str), ("tools", str)}


def check_types(values: dict, dataclass_type: type) -> None:
    """`learning_rate=abc` or `max_steps=ten` fails here, not as a traceback inside TRL."""
    hints = typing.get_type_hints(dataclass_type)
    for key, value in values.items():
        if (key, type(value)) in _ALSO_ALLOWED:
            continue
        if value is not None and key in hints and not _matches(value, hints[key]):
            kind = _describe(hints[key])
            raise RecipeError(f"{key}: {value!r} is not {kind}: give {key} as {kind}")


# key -> (lowest allowed, highest allowed, whether the lowest is excluded)
_RANGES: dict[str, tuple[float, float, bool]] = {
    **dict.fromkeys(("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
                     "max_prompt_length", "num_iterations", "steps_per_generation", "generation_batch_size",
                     "logging_steps", "save_steps", "save_total_limit", "eval_num_samples", "eval_max_new_tokens",
                     "eval_batch_size", "dataset_size", "eval_limit", "budget_tokens", "budget_rollouts",
                     "budget_eval_points", "num_generations", "probe_buffer_rows", "probe_prompt_components",
                     "probe_response_components", "num_train_epochs", "gpus", "ddp_timeout", "tool_result_tokens",
                     "max_tool_calling_iterations"), (0, math.inf, True)),
    **dict.fromkeys(("learning_rate", "temperature", "repetition_penalty", "tool_timeout"), (0, math.inf, True)),
    **dict.fromkeys(("eval_every", "warmup_steps", "beta", "epsilon", "epsilon_high", "weight_decay", "max_grad_norm",
                     "probe_bootstrap_steps", "probe_ridge_alpha", "eval_temperature", "seed", "data_seed"),
                    (0, math.inf, False)),
    **dict.fromkeys(("top_p", "min_p", "warmup_ratio", "adam_beta1", "adam_beta2", "peft.lora_dropout"),
                    (0, 1, False)),
    "peft.r": (0, math.inf, True),
}


def _range_error(key: str, value: Any, low: float, high: float, open_low: bool) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if (value <= low if open_low else value < low) or value > high:
        if high == 1 and low == 0:
            wanted = "a probability in [0, 1]"
        else:
            wanted = f"{'>' if open_low else '>='} {low:g}" + ("" if high == math.inf else f" and <= {high:g}")
        return f"{key}: {value!r} is out of range: give {key} {wanted}"
    return None


def check_ranges(recipe: dict, algorithm=None) -> None:
    """Ranges, e.g. `max_steps=0` (TRL trains one step) or `max_steps=-5` (TRL trains 3 epochs), and with an
    `algorithm` the rules that depend on it (POISE with one rollout per prompt)."""
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
    generations = recipe.get("num_generations")
    if algorithm and isinstance(generations, int) and generations < algorithm.min_generations:
        raise RecipeError(f"num_generations: {generations}: {algorithm.display_name} needs at least "
                          f"{algorithm.min_generations} rollouts per prompt "
                          f"({algorithm.min_generations_reason}); set num_generations >= "
                          f"{algorithm.min_generations} (or algo: reinforce_pp for one)")


@dataclass
class RunPlan:
    """A recipe parsed once (`parse_recipe`): its run settings, the algorithm, the config keys it sets, and
    the config object built for this machine (CPU: `use_cpu`, no bf16). `plan`, `build` and `train` read
    it."""

    recipe: dict
    algorithm: Algorithm
    settings: RunSettings
    config_kwargs: dict
    args: object

    def requested(self, key: str):
        """A config value as the recipe asks for it, whatever this machine is (`poise plan` sizes a GPU
        launch from a CPU machine)."""
        return requested_value(self.algorithm, self.config_kwargs, key)


def requested_value(algorithm: Algorithm, config_kwargs: dict, key: str):
    """The recipe's own value of a config key, else the algorithm's default; None for a key the
    algorithm's config does not have (A*-PO has no vLLM switch)."""
    if key in config_kwargs:
        return config_kwargs[key]
    default = algorithm.config_class.__dataclass_fields__.get(key)
    if default is None:
        return None
    if default.default is not dataclasses.MISSING:
        return default.default
    return default.default_factory() if default.default_factory is not dataclasses.MISSING else None


def parse_recipe(recipe: dict, output_dir: str | None = None) -> RunPlan:
    # torch, TRL and datasets load here, after `load_recipe` and the commands have checked what they can
    from poise_trl.algorithms import get_algorithm  # noqa: PLC0415 (see above)
    from poise_trl.tasks import is_task  # noqa: PLC0415 (see above)

    algorithm = get_algorithm(recipe.get("algo", "grpo"))
    settings, config_kwargs = split_recipe(recipe, algorithm)
    if settings.rewards is None:
        settings.rewards = ["task"] if is_task(settings.dataset) else ["math_accuracy"]
    elif isinstance(settings.rewards, str):  # `rewards: math_accuracy`
        settings.rewards = [settings.rewards]
    takes_turn_limit = "max_tool_calling_iterations" in algorithm.config_class.__dataclass_fields__
    if (settings.tools or settings.environment) and takes_turn_limit:
        config_kwargs = {"max_tool_calling_iterations": DEFAULT_TOOL_TURNS, **config_kwargs}
    if isinstance(settings.dataset, list):  # a task mix: the algorithm's settings for one (the recipe's win)
        config_kwargs = {**algorithm.task_mix_settings, **config_kwargs}
    args = build_config(algorithm, config_kwargs, output_dir)
    return RunPlan(recipe, algorithm, settings, config_kwargs, args)


def build_config(algorithm: Algorithm, config_kwargs: dict, output_dir: str | None):
    fields = algorithm.config_class.__dataclass_fields__
    kwargs = dict(config_kwargs)
    if output_dir is not None:
        kwargs["output_dir"] = output_dir
    kwargs.setdefault("output_dir", f"runs/{algorithm.name}")
    kwargs.setdefault("report_to", "none")
    # Every collective (the probe's small gathers included) gives up after this, not after the
    # 30 minutes of torch's default: a dead or stopped rank ends the run with its name
    # (core/distributed.naming_a_lost_rank). Raise ddp_timeout when one step's generation or a
    # held-out evaluation, which the other ranks wait for, takes longer.
    kwargs.setdefault("ddp_timeout", DEFAULT_COLLECTIVE_TIMEOUT_S)
    kwargs["disable_tqdm"] = True  # the rich display replaces tqdm
    if kwargs.get("log_completions") and "num_completions_to_print" in fields:
        kwargs.setdefault("num_completions_to_print", 4)  # TRL prints every row of the table at each log
    import torch  # noqa: PLC0415 (see parse_recipe)

    if not torch.cuda.is_available():
        kwargs.update(use_cpu=True, bf16=False)
        kwargs.setdefault("gradient_checkpointing", False)
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing and warns on the old name,
    # TRL's, which recipes keep: it is handed on under the new one.
    if "activation_checkpointing" in fields:
        for old in ("gradient_checkpointing", "gradient_checkpointing_kwargs"):
            kwargs.setdefault(old.replace("gradient", "activation"), kwargs.pop(old, fields[old].default))
    if "num_generations" in fields:  # A*-PO: one rollout per prompt
        check_batch_geometry({key: requested_value(algorithm, config_kwargs, key) for key in
                              ("num_generations", "per_device_train_batch_size", "steps_per_generation",
                               "gradient_accumulation_steps", "generation_batch_size")})
    try:
        return algorithm.config_class(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"invalid settings for algo {algorithm.name!r}: {exc}") from None


def check_batch_geometry(values: dict) -> None:
    """Catch the batch sizes TRL would reject later, with the fix spelled out."""
    num_generations = values.get("num_generations", 8)
    per_device = values.get("per_device_train_batch_size", 8)
    steps = values.get("steps_per_generation") or values.get("gradient_accumulation_steps", 1)
    generation_batch = values.get("generation_batch_size") or per_device * steps
    if generation_batch % num_generations:
        example = num_generations * max(1, per_device // num_generations)
        raise RecipeError(
            f"generation batch size {generation_batch} (per_device_train_batch_size={per_device} x "
            f"steps_per_generation={steps}) is not divisible by num_generations={num_generations}: every prompt needs "
            f"its {num_generations} rollouts in the same batch. Make per_device_train_batch_size x "
            f"steps_per_generation a multiple of {num_generations} (e.g. per_device_train_batch_size={example})"
        )
