"""`reasoning-gym:<generator>`: reasoning-gym's procedural generators, graded by their own verifiers.

Rows are `reasoning_gym.create_dataset(name, size=size, seed=seed, **config)` (test: another seed, train
questions dropped); reward: the generator's `score_answer` on the `<answer>` text. Details: docs/tasks.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from functools import lru_cache

import numpy as np
import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS

from poise_trl.tasks.family import TaskError, TaskFamily, extract_tagged_answer

TEST_SEED_OFFSET = 1_000_000
DEFAULT_TRAIN_SIZE = 1000
DEFAULT_TEST_SIZE = 200
DEFAULT_SYSTEM_PROMPT = "DeepSeekZero"
FAMILY_KEYS = frozenset({"system_prompt"})  # keys of this family, not of a generator
SET_BY_TASK = frozenset({"size", "seed"})

# Their score_answer compares parsed boards with metadata tuples, which JSON turns into lists.
SCORED_ON_REGENERATED_ENTRY = frozenset({"arc_agi", "rearc"})
# `composite` mixes other generators, which a recipe does itself with one task per generator.
NOT_OFFERED = frozenset({"composite"})


def generator_names() -> list[str]:
    return sorted(set(DATASETS) - NOT_OFFERED)


def generator_keys(name: str) -> list[str]:
    """The config keys a recipe may give generator `name` (its config dataclass, less size and seed)."""
    return sorted(f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in SET_BY_TASK)


def check_generator(name: str | None) -> str:
    if name is None:
        raise TaskError("reasoning-gym needs a generator: name the task reasoning-gym:<generator>, "
                        "e.g. reasoning-gym:leg_counting")
    if name in NOT_OFFERED:
        raise TaskError(f"reasoning-gym:{name} mixes generators; give each generator its own task "
                        f"(reasoning-gym:<generator>) in the recipe instead")
    if name not in DATASETS:
        names = generator_names()
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"generators: {', '.join(names)}"
        raise TaskError(f"unknown reasoning-gym generator {name!r}; {hint}")
    return name


def split_config(name: str, config: dict) -> tuple[dict, str]:
    """(the generator's config, the system prompt's text); one line naming the allowed keys on a bad key."""
    keys = generator_keys(name)
    if SET_BY_TASK & config.keys():
        raise TaskError(f"reasoning-gym:{name}: set size and seed on the task, not in its config")
    unknown = sorted(config.keys() - set(keys) - FAMILY_KEYS)
    if unknown:
        raise TaskError(f"reasoning-gym:{name} has no config key {', '.join(map(repr, unknown))}; "
                        f"its keys are {', '.join(keys)} (and system_prompt)")
    generator_config = {k: v for k, v in config.items() if k not in FAMILY_KEYS}
    prompt_name = config.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
    if prompt_name not in SYSTEM_PROMPTS:
        raise TaskError(f"reasoning-gym system_prompt {prompt_name!r} is not one of reasoning-gym's: "
                        f"{', '.join(SYSTEM_PROMPTS)}")
    return generator_config, SYSTEM_PROMPTS[prompt_name]


def create_dataset(name: str, kwargs: dict):
    try:
        return reasoning_gym.create_dataset(name, **kwargs)
    except (AssertionError, ValueError, TypeError) as error:  # the generator's own config validation
        raise TaskError(f"reasoning-gym:{name} rejects config {kwargs}: {error}") from None


def jsonable(value):
    """`value` in plain JSON types, so a verifier survives being written to disk or sent to a worker."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # Fraction, sympy expressions...: their text is what a reader needs


def generate(name: str, kwargs: dict) -> list[dict]:
    """The entries of `create_dataset(name, **kwargs)`, as JSON-safe rows of this family."""
    return [{"index": i, "entry": jsonable(entry)} for i, entry in enumerate(create_dataset(name, kwargs))]


def to_row(name: str, kwargs: dict, system_prompt: str, index: int, entry: dict) -> dict:
    answer = entry["answer"]
    return {
        "id": f"{name}/{kwargs['seed']}/{index}",
        "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": entry["question"]}],
        "answer": "" if answer is None else str(answer),
        "verifier": {"name": name, "config": kwargs, "index": index, "entry": entry},
    }


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    name = check_generator(variant)
    generator_config, system_prompt = split_config(name, config)
    if split not in ("train", "test"):
        raise TaskError(f"reasoning-gym split must be 'train' or 'test', got {split!r}")
    train_kwargs = {**generator_config, "size": size or DEFAULT_TRAIN_SIZE, "seed": seed}
    if split == "train":
        kwargs, generated = train_kwargs, generate(name, train_kwargs)
    else:
        kwargs = {**generator_config, "size": size or DEFAULT_TEST_SIZE, "seed": seed + TEST_SEED_OFFSET}
        train_questions = {g["entry"]["question"] for g in generate(name, train_kwargs)}
        generated = [g for g in generate(name, kwargs) if g["entry"]["question"] not in train_questions]
    return [to_row(name, kwargs, system_prompt, g["index"], g["entry"]) for g in generated]


@lru_cache(maxsize=64)
def cached_dataset(name: str, kwargs_json: str):
    """One dataset object per generator and config: score_answer reads the config, and building some is slow."""
    return create_dataset(name, json.loads(kwargs_json))


def score(completion: str, verifier: dict) -> float:
    answer = extract_tagged_answer(completion)
    if answer is None:
        return 0.0
    name = verifier["name"]
    dataset = cached_dataset(name, json.dumps(verifier["config"], sort_keys=True))
    entry = dataset[verifier["index"]] if name in SCORED_ON_REGENERATED_ENTRY else verifier["entry"]
    try:
        reward = float(dataset.score_answer(answer, entry))
    except Exception:  # some verifiers raise on answers they cannot parse (prime_factorization on words)
        return 0.0
    return min(max(reward, 0.0), 1.0)


TASK = TaskFamily(
    name="reasoning-gym",
    description="reasoning-gym's procedural generators (reasoning-gym:<generator>), graded by their own "
                "score_answer",
    answer_format="<think>...</think><answer>...</answer>",
    build_rows=build_rows,
    score=score,
    config_keys=frozenset(k for name in generator_names() for k in generator_keys(name)) | FAMILY_KEYS,
    variants=generator_names,
)
