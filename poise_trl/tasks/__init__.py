"""Task families: where a run's prompts come from and how each completion is rewarded.

A task family is one module in this folder that defines `TASK = TaskFamily(...)`:
- `build_rows(variant, config, split, size, seed)` -> rows, each a dict with
  `id` (str, unique within the family and variant), `prompt` (a list of chat messages),
  `answer` (str: the gold, for display and for the math grader) and `verifier` (a JSON-serialisable
  dict: whatever `score` needs, e.g. a reasoning-gym entry, HumanEval's tests, BFCL's possible answers);
- `score(completion_text, verifier)` -> a reward in [0, 1];
- optionally `score_batch(completion_texts, verifiers)` -> list of rewards, where a family grades many
  completions faster together (a process pool, a sandbox pool).

`split` is "train" or "test": generated families draw the test split from another seed and drop any
question the train split holds; fixed sets (HumanEval, BFCL) partition by a stable hash of the row id.
`variant` is the part after the colon in a task name (`reasoning-gym:leg_counting`), None without one.

The registration line of a family is its entry in `FAMILIES` (the module is imported on first use, so a
family's heavy dependencies load only when a run names it).

Non-math families share one answer rule (`extract_tagged_answer`): the answer is the text inside the last
`<answer>...</answer>` after the last `</think>`; a completion that opened `<think>` and never closed it
has no answer.
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class TaskError(ValueError):
    """A task name, variant or config key the user must fix; the message says how."""


@dataclass(frozen=True)
class TaskFamily:
    name: str
    description: str
    answer_format: str  # what the prompts ask the model to write, e.g. "<answer>...</answer>"
    build_rows: Callable[[str | None, dict, str, int | None, int], list[dict]]
    score: Callable[[str, dict], float]
    score_batch: Callable[[list[str], list[dict]], list[float]] | None = None
    config_keys: frozenset[str] = frozenset()  # keys a recipe's task_config may give this family
    variants: Callable[[], list[str]] | None = None  # the names after the colon, for suggestions


# family name -> module defining TASK; one line per family.
FAMILIES: dict[str, str] = {
    "reasoning-gym": "poise_trl.tasks.reasoning_gym",
    "bfcl": "poise_trl.tasks.bfcl",
    "ifeval": "poise_trl.tasks.ifeval",
    "humaneval": "poise_trl.tasks.humaneval",
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


_THINK_CLOSE = "</think>"
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_part(text: str) -> str | None:
    """What the completion says after its thinking: the text after the last `</think>`, all of it without
    one; None when it opened `<think>` and never closed it (cut off mid-thought)."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    return None if "<think>" in text else text


def extract_tagged_answer(text: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>` of the answer part (`answer_part`); None if there
    is none."""
    text = answer_part(text)
    if text is None:
        return None
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def is_task(source: str) -> bool:
    """Whether a dataset name names a task family (`reasoning-gym:leg_counting`), not a file or a math set."""
    return split_task_name(source)[0] in FAMILIES


def task_rows(name: str, split: str, size: int | None, seed: int, config: dict | None = None) -> list[dict]:
    """The rows of task `name` for `split`, as dataset rows: `prompt`, `answer`, `task` (the name, which
    routes each row to its verifier in a mixed dataset), `verifier` (JSON text: one column type for every
    family) and `id`."""
    family, variant = get_family(name), split_task_name(name)[1]
    config = dict(config or {})
    unknown = sorted(set(config) - family.config_keys)
    if unknown:  # a family with variants may check its variant's own keys more narrowly in build_rows
        close = difflib.get_close_matches(unknown[0], family.config_keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        allowed = ", ".join(sorted(family.config_keys)) if len(family.config_keys) <= 20 else "see its module"
        raise TaskError(f"unknown task_config key {unknown[0]!r} for task {name!r}{hint} (allowed: {allowed or 'none'})")
    rows = family.build_rows(variant, config, split, size, seed)
    return [{"prompt": row["prompt"], "answer": str(row["answer"]), "task": name,
             "verifier": json.dumps(row["verifier"], sort_keys=True), "id": str(row["id"])} for row in rows]


def score_rows(texts: Sequence[str], tasks: Sequence[str], verifiers: Sequence[str]) -> list[float]:
    """Each completion text scored by its row's family, families batched together."""
    rewards = [0.0] * len(texts)
    by_task: dict[str, list[int]] = {}
    for i, name in enumerate(tasks):
        by_task.setdefault(name, []).append(i)
    for name, rows in by_task.items():
        family = get_family(name)
        row_texts = [texts[i] for i in rows]
        row_verifiers = [json.loads(verifiers[i]) for i in rows]
        if family.score_batch is not None:
            scores = family.score_batch(row_texts, row_verifiers)
        else:
            scores = [family.score(text, verifier) for text, verifier in zip(row_texts, row_verifiers, strict=True)]
        for i, score in zip(rows, scores, strict=True):
            rewards[i] = min(1.0, max(0.0, float(score)))
    return rewards


def task_reward(completions, task, verifier, **kwargs) -> list[float]:
    """TRL reward function (recipe name `task`): each row's own verifier, by its `task` column."""
    return score_rows([completion_text(c) for c in completions], task, verifier)


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
