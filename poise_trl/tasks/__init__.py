"""Task families: where a run's prompts come from and how each completion is rewarded.

A family is one module here defining `TASK = TaskFamily(...)` (`build_rows` gives rows with `id`, `prompt`,
`answer`, `verifier`; `score` a reward in [0, 1]), registered by its line in `FAMILIES`. A task mix
(`mix_rows`) keeps each row's `task` column so the `task` reward routes it. Details: docs/tasks.md.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import yaml

# The module, read at call time: prompts imports tasks.math_grader, which runs this package first, so
# `from poise_trl.tasks.prompts import ...` would fail where prompts is imported before the package.
from poise_trl.tasks import prompts
from poise_trl.tasks.family import TaskError, TaskFamily

# family name -> module defining TASK; one line per family.
FAMILIES: dict[str, str] = {
    "reasoning-gym": "poise_trl.tasks.reasoning_gym",
    "bfcl": "poise_trl.tasks.bfcl",
    "bfcl-multi": "poise_trl.tasks.bfcl_multi",
    "ifeval": "poise_trl.tasks.ifeval",
    "humaneval": "poise_trl.tasks.humaneval",
    "math": "poise_trl.tasks.math_sets",
    "toolworld": "poise_trl.tasks.toolworld",
}


def split_task_name(name: str) -> tuple[str, str | None]:
    """`reasoning-gym:leg_counting` -> ("reasoning-gym", "leg_counting"); `bfcl` -> ("bfcl", None)."""
    family, _, variant = str(name).partition(":")
    return family, variant or None


def get_family(name: str) -> TaskFamily:
    """The family of a task name (`reasoning-gym:leg_counting` -> the reasoning-gym family)."""
    family = split_task_name(name)[0]
    if family not in FAMILIES:
        close = difflib.get_close_matches(family, FAMILIES, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise TaskError(f"unknown task {name!r}{hint} (task families: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[family]).TASK


def is_task(source) -> bool:
    """Whether a dataset names a task family (`reasoning-gym:leg_counting`) or a task mix (a list of entries,
    see `mix_rows`), not a file or a math set."""
    return isinstance(source, (list, tuple)) or split_task_name(source)[0] in FAMILIES


def task_rows(name: str, split: str, size: int | None, seed: int, config: dict | None = None) -> list[dict]:
    """The rows of task `name` for `split`, as dataset rows: `prompt`, `answer`, `task` (the name, which
    routes each row to its verifier in a mixed dataset), `verifier` (JSON text: one column type for every
    family) and `id`."""
    family, variant = get_family(name), split_task_name(name)[1]
    config = dict(config or {})
    unknown = sorted(set(config) - family.config_keys)
    if unknown and (family.variants is None or variant is None):  # a variant's build_rows names its own keys
        close = difflib.get_close_matches(unknown[0], family.config_keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        allowed = ", ".join(sorted(family.config_keys)) if len(family.config_keys) <= 20 else "see its module"
        raise TaskError(f"unknown task_config key {unknown[0]!r} for task {name!r}{hint} (allowed: "
                        f"{allowed or 'none'})")
    rows = family.build_rows(variant, config, split, size, seed)
    return [{"prompt": row["prompt"], "answer": str(row["answer"]), "task": name,
             "verifier": json.dumps(row["verifier"], sort_keys=True), "id": str(row["id"])} for row in rows]


MIX_KEYS = ("name", "weight", "size", "seed", "config")


@dataclass(frozen=True)
class MixEntry:
    """One task of a mix; size and seed None: the mix's share and seed."""

    name: str
    weight: float = 1.0
    size: int | None = None
    seed: int | None = None
    config: dict | None = None


def _is_count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def mix_entry(entry) -> MixEntry:
    """A mix entry checked: a task name, or a mapping with keys among MIX_KEYS; one line on a bad one."""
    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, dict):
        raise TaskError(f"dataset mix entry {entry!r} ({type(entry).__name__}) is neither a task name nor a mapping: "
                        f"give a task name or a mapping with keys {', '.join(MIX_KEYS)}")
    label = entry.get("name", entry)
    unknown = sorted(set(entry) - set(MIX_KEYS), key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), MIX_KEYS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TaskError(f"dataset mix entry {label!r}: unknown key {unknown[0]!r}{hint} (allowed: "
                        f"{', '.join(MIX_KEYS)})")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise TaskError(f"dataset mix entry {entry!r} has no task name: give name: <task>, e.g. "
                        "name: reasoning-gym:leg_counting")
    get_family(name)  # an unknown task: one line with the closest names
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
        raise TaskError(f"dataset mix entry {name!r}: weight {weight!r} is not a positive number; give weight > 0")
    for key, low in (("size", 1), ("seed", 0)):
        if entry.get(key) is not None and not _is_count(entry[key], low):
            raise TaskError(f"dataset mix entry {name!r}: {key} {entry[key]!r} is not an integer >= {low}")
    if entry.get("config") is not None and not isinstance(entry["config"], dict):
        raise TaskError(f"dataset mix entry {name!r}: config {entry['config']!r} is not a mapping of the task's keys")
    return MixEntry(name, float(weight), entry.get("size"), entry.get("seed"), entry.get("config"))


def dataset_label(dataset) -> str:
    """How tables and cards name a run's data: the name, or a mix as `a + 2x b` (weights other than 1 shown)."""
    if not isinstance(dataset, list):
        return str(dataset)
    entries = [mix_entry(entry) for entry in dataset]
    return " + ".join(f"{e.weight:g}x {e.name}" if e.weight != 1 else e.name for e in entries)


def weighted_shares(total: int, weights: Sequence[float]) -> list[int]:
    """`total` rows split in proportion to `weights`, summing to `total` exactly (largest remainders first)."""
    exact = [total * weight / sum(weights) for weight in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def mix_sizes(entries: Sequence[MixEntry], split: str, total_size: int | None) -> list[int | None]:
    """Rows of each entry on the train split: its `size`, else a weighted share of what `total_size` leaves.

    Without a total size such entries take their family's default (None), so differing weights are refused.
    The test split is shared out of `total_size` alone.
    """
    own = [entry.size if split == "train" else None for entry in entries]
    rest = [i for i, size in enumerate(own) if size is None]
    if not rest:
        return own
    if total_size is None:
        if split == "train" and len({entries[i].weight for i in rest}) > 1:
            raise TaskError("dataset mix: weights share a total number of rows; set the recipe's dataset_size (or "
                            "give each entry its own size)")
        return own
    left = total_size - sum(size for size in own if size is not None)
    shares = weighted_shares(max(left, 0), [entries[i].weight for i in rest])
    if min(shares) < 1:
        starved = entries[rest[shares.index(min(shares))]].name
        raise TaskError(f"dataset mix: a total of {total_size} rows leaves none for {starved!r} (entries' own sizes: "
                        f"{total_size - left}); raise the total size or lower the other entries' sizes")
    for i, share in zip(rest, shares, strict=True):
        own[i] = share
    return own


def mix_rows(entries: Sequence, split: str, total_size: int | None, seed: int) -> list[dict]:
    """The rows of a task mix for `split`: each entry's `task_rows` (its size from `mix_sizes`, its own seed
    or `seed`, its config), concatenated and shuffled by `seed`. On the test split every entry gives its
    task's held-out rows (drawn by the family from another seed than its train rows)."""
    if not entries:
        raise TaskError("dataset: the task mix is empty; list task names or {name: <task>, weight: <w>} entries")
    mix = [mix_entry(entry) for entry in entries]  # every entry checked before any row is generated
    sizes = mix_sizes(mix, split, total_size)
    rows = [row for entry, size in zip(mix, sizes, strict=True)
            for row in task_rows(entry.name, split, size, seed if entry.seed is None else entry.seed, entry.config)]
    random.Random(seed).shuffle(rows)
    return rows


def by_task_means(tasks: Sequence[str], values: Sequence[float | None]) -> dict[str, float]:
    """Mean of `values` per task, by task name in sorted order. None and NaN (TRL's "not my row") are left
    out, and so is a task with no value left."""
    groups: dict[str, list[float]] = {}
    for task, value in zip(tasks, values, strict=True):
        if value is not None and not math.isnan(value):
            groups.setdefault(task, []).append(float(value))
    return {task: sum(group) / len(group) for task, group in sorted(groups.items())}


def score_rows(completions: Sequence, tasks: Sequence[str], verifiers: Sequence[str],
               verdicts: dict[str, dict[str, int]] | None = None) -> list[float]:
    """Each completion (a text, or a conversation: TRL's message list) scored by its row's family, families
    batched together; `verdicts` gets, per task whose family gives verdicts, how many completions ended in each.
    A conversation is graded on its last message, or on every assistant message where the family says so."""
    rewards = [0.0] * len(completions)
    by_task: dict[str, list[int]] = {}
    for i, name in enumerate(tasks):
        by_task.setdefault(name, []).append(i)
    for name, rows in by_task.items():
        family = get_family(name)
        row_texts = [completion_text(completions[i]) for i in rows]
        row_verifiers = [json.loads(verifiers[i]) for i in rows]
        if family.score_conversation is not None:
            scores = [family.score_conversation(assistant_texts(completions[i]), verifier)
                      for i, verifier in zip(rows, row_verifiers, strict=True)]
        elif family.grade_batch is not None:
            scores, ends = zip(*family.grade_batch(row_texts, row_verifiers), strict=True)
            if verdicts is not None:
                verdicts[name] = {verdict: ends.count(verdict) for verdict in family.verdicts}
        elif family.score_batch is not None:
            scores = family.score_batch(row_texts, row_verifiers)
        else:
            scores = [family.score(text, verifier) for text, verifier in zip(row_texts, row_verifiers, strict=True)]
        for i, score in zip(rows, scores, strict=True):
            rewards[i] = min(1.0, max(0.0, float(score)))
    return rewards


def task_reward(completions, task, verifier, log_metric=None, **kwargs) -> list[float]:
    """TRL reward function (recipe name `task`): each row's own verifier, by its `task` column. Logs
    `rewards/<task>/verdicts/<verdict>`: how many of the batch's completions ended so (code tasks)."""
    verdicts = {}
    rewards = score_rows(completions, task, verifier, verdicts)
    for name, counts in verdicts.items():
        for verdict, count in counts.items():
            if log_metric is not None:
                log_metric(f"rewards/{name}/verdicts/{verdict}", count)
    return rewards


def completion_text(completion) -> str:
    """Plain text of a completion: TRL passes strings, or message lists for conversational datasets."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    message = completion[-1]  # the model's final reply; earlier messages are tool-calling turns
    content = message.get("content") or ""
    if isinstance(content, list):  # content given as typed blocks
        content = "".join(block.get("text", "") for block in content if block.get("type") == "text")
    # Tokenizers with a response schema split the thinking into its own field; put it back so that the
    # `</think>` rules see what the model actually wrote.
    reasoning = message.get("reasoning_content") or message.get("thinking")
    return f"<think>\n{reasoning}\n</think>\n{content}" if reasoning else content


def assistant_texts(completion) -> list[str]:
    """Each assistant message's text (`completion_text`) of a conversation; a text is one message."""
    if isinstance(completion, str):
        return [completion]
    return [completion_text([message]) for message in completion if message.get("role") == "assistant"]


MIX_FILE_SUFFIXES = (".yaml", ".yml")


def resolve_dataset(dataset: str | list, option: str = "--dataset") -> str | list:
    """What `load_prompt_dataset` reads for a dataset named on the command line (`option`).

    A YAML file gives its `dataset:` list; `a+b` task names are an equal-weight mix; anything else is itself.
    """
    if isinstance(dataset, (list, tuple)):
        return list(dataset)
    path = Path(dataset)
    if path.suffix in MIX_FILE_SUFFIXES:
        return read_mix_file(path, option)
    if "+" in dataset and not path.exists():
        names = [name.strip() for name in dataset.split("+")]
        if not all(names):
            raise TaskError(f"{option} {dataset!r} has an empty task name; join task names with '+', e.g. "
                            "reasoning-gym:leg_counting+reasoning-gym:chain_sum")
        return names
    return dataset


def read_mix_file(path: Path, option: str = "--dataset") -> list:
    """The `dataset:` list of a YAML file (a recipe's mix: task names or {name, weight, size, seed, config})."""
    if not path.is_file():
        raise TaskError(f"{option} {path}: no such mix file")
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise TaskError(f"{option} {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    mix = content.get("dataset") if isinstance(content, dict) else None
    if not isinstance(mix, list) or not mix:
        raise TaskError(f"{option} {path} has no `dataset:` list; give one, e.g. dataset: "
                        "[reasoning-gym:leg_counting, {name: reasoning-gym:chain_sum, weight: 2}]")
    return mix


def refuse_near_miss(name: str) -> None:
    """Refuse a dataset name that is no file and no registered dataset but one typo from one (`toy-arithh`),
    or names an unknown family before a colon, with the names it resembles: before any hub lookup, which
    offline would only answer with a network error. Hub ids are owner/name."""
    if "/" in name or name in prompts.DATASETS or Path(name).exists():
        return
    if ":" in name:
        get_family(name)  # an unknown family: one line with the closest ones
    close = difflib.get_close_matches(name, [*prompts.DATASETS, *FAMILIES], n=3, cutoff=0.75)
    if close:
        raise TaskError(f"unknown dataset {name!r}; did you mean {' or '.join(map(repr, close))}? (a hub "
                        "dataset is written owner/name)")


def load_prompt_dataset(source: str | Path | list, split: str | None = None, columns: dict[str, str] | None = None,
                        prompt_suffix: str | None = None, system_prompt: str | None = None,
                        limit: int | None = None, seed: int = 0, config: str | None = None,
                        column_option: str | None = None,
                        task_config: dict | None = None) -> datasets.Dataset:
    """Any dataset a recipe or a command names, as prompt rows.

    A task name gives that family's rows for `split` ("test", "all", else train), `limit` of them seeded by
    `seed`, with `task_config`; a list is a task mix (`mix_rows`); anything else is a math dataset
    (`prompts.load_math_dataset`, which documents the other arguments).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    if isinstance(source, (list, tuple)):  # a task mix: each entry names its own config
        if task_config:
            raise TaskError("task_config sets one task's keys; in a task mix give each entry its own config: "
                            "{name: <task>, config: {...}}")
        mix_split = "test" if split == "test" else "train"
        return datasets.Dataset.from_list(mix_rows(source, mix_split, limit, seed))
    if is_task(str(source)):  # rows and verifiers come from the task family
        task_split = split if split in ("test", "all") else "train"  # `all`: a fixed set whole (bfcl, ...)
        return datasets.Dataset.from_list(task_rows(str(source), task_split, limit, seed, task_config))
    refuse_near_miss(str(source))
    return prompts.load_math_dataset(source, split, columns, prompt_suffix, system_prompt, limit, seed, config,
                                     column_option or prompts.RECIPE_COLUMN_OPTION)


def row_verifiers(rows) -> tuple[list[str], list[str]]:
    """Each row's task and verifier (JSON), for a `datasets.Dataset` or a list of its rows: a task row's own;
    a math dataset's row is the math family's (`math_sets`), graded against its `answer` as the
    `math_accuracy` reward grades it."""
    if isinstance(rows, datasets.Dataset):
        rows = rows.select_columns([c for c in ("task", "verifier", "answer") if c in rows.column_names])
        rows = rows.to_list()
    return ([row.get("task", "math") for row in rows],
            [row["verifier"] if "task" in row else json.dumps({"answer": row["answer"]}) for row in rows])
