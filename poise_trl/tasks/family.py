"""What a task family is (`TaskFamily`), its error, and the answer and split rules the non-math families share; the
families import this module, and `tasks` (the registry) loads them by name."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
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
    # (reward, verdict) per completion, verdicts among `verdicts`: `task_reward` logs their counts per step
    grade_batch: Callable[[list[str], list[dict]], list[tuple[float, str]]] | None = None
    verdicts: tuple[str, ...] = ()
    # A family graded on every assistant message of a tool-calling conversation (bfcl-multi: each one a step of
    # calls) instead of the last one, and the tools of one rollout (evaluation/agent.py: calls, call, close).
    score_conversation: Callable[[list[str], dict], float] | None = None
    tool_session: Callable[[dict], object] | None = None


# Share of a fixed set (HumanEval's problems, BFCL's questions, IFEval prompts) held out as its test split.
TEST_PERCENT = 20


def split_of(key: str) -> str:
    """The split ("test" or "train") of an item of a fixed set, by a stable hash of its key (an id, a prompt)."""
    return "test" if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < TEST_PERCENT else "train"


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
