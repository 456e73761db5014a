"""Reward functions: the registry a recipe's `rewards:` names (`math_accuracy`, `format`, `task`), the user's
own by import path (`package.module:function`), and a dry-batch check of each before training.

They follow TRL's signature, `f(completions, **dataset_columns) -> list[float]`, logged as
`rewards/<function name>`. Grading lives with the tasks (`tasks/math_grader.py`, each family's verifier).
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable, Sequence

from torch import nn
from transformers import TrainerState

from poise_trl.core.loading import import_callable
from poise_trl.tasks import completion_text, task_reward
from poise_trl.tasks.math_grader import extract_final_answer, grade_batch


def math_accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final answer matches the dataset's `answer` column, else 0.0."""
    pairs = [(completion_text(c), gold) for c, gold in zip(completions, answer, strict=True)]
    return [float(correct) for correct in grade_batch(pairs)]


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion closes its thinking exactly once and then gives a `\\boxed{}` answer."""
    texts = [completion_text(c) for c in completions]
    return [float(text.count("</think>") == 1 and extract_final_answer(text) is not None) for text in texts]


REWARD_FUNCTIONS: dict[str, Callable[..., list[float]]] = {
    "math_accuracy": math_accuracy_reward,
    "format": format_reward,
    "task": task_reward,
}


def get_reward_functions(names: list[str]) -> list[Callable[..., list[float]]]:
    """The reward functions a recipe names (`rewards: [math_accuracy, my_pkg.rewards:length_penalty]`), in
    order: a built-in name, or an import path `module:function` of a TRL reward function."""
    if isinstance(names, str):  # `rewards: math_accuracy` in YAML gives a bare string
        names = [names]
    unknown = [name for name in names if name not in REWARD_FUNCTIONS and ":" not in name]
    if unknown or not names:
        problem = f"unknown reward function(s): {', '.join(unknown)}" if unknown else "no reward functions given"
        raise ValueError(f"{problem}; known reward functions: {', '.join(REWARD_FUNCTIONS)}, or an import path "
                         "package.module:function")
    return [REWARD_FUNCTIONS[name] if name in REWARD_FUNCTIONS else import_callable(name, "reward function")
            for name in names]


DRY_BATCH_ROWS = 2
MAX_ERROR_CHARS = 300  # of an exception's message in the one-line error


class RewardFunctionError(ValueError):
    """A reward function that fails on a dry batch; the message names it and what went wrong."""


def dry_completion(row: dict, answered: bool) -> str:
    """A made-up completion for a dry batch: the row's gold in its answer format (`<answer>` for a task row,
    `\\boxed{}` for math), or nothing."""
    if not answered:
        return ""
    gold = row.get("answer", "")
    return f"<think>\n</think>\n<answer>{gold}</answer>" if "task" in row else f"<think>\n</think>\n\\boxed{{{gold}}}"


def _no_op(*args, **kwargs) -> None:
    """Stands in for the trainer's `log_extra` / `log_metric` on a dry batch."""


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _problem(output, rows: int) -> str | None:
    """What is wrong with a reward function's output on `rows` rows, None when nothing is."""
    if not isinstance(output, list):
        return f"returned a {type(output).__name__}, not a list of rewards"
    if len(output) != rows:
        return f"returned {len(output)} rewards for {rows} completions"
    bad = next((value for value in output if value is not None and not isinstance(value, numbers.Real)), None)
    if bad is not None:
        return f"returned {bad!r} ({type(bad).__name__}) among its rewards, not a number or None"
    return None


def check_reward_functions(funcs: Sequence, dataset, tokenizer, names: Sequence[str] | None = None) -> None:
    """Call each reward function once on DRY_BATCH_ROWS rows with made-up completions, as TRL calls it.

    One that raises or returns anything but one number (or None) per completion is a RewardFunctionError
    naming it (`names`, the recipe's spelling, else `__name__`). Reward models are left to TRL.
    """
    rows = [dataset[i] for i in range(min(DRY_BATCH_ROWS, len(dataset)))]
    if not rows:
        return
    texts = [dry_completion(row, answered=i == 0) for i, row in enumerate(rows)]
    prompts = [row["prompt"] for row in rows]
    conversational = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion",
                                                                                "completion_ids")}
    kwargs = dict(prompts=prompts, completions=completions,
                  completion_ids=[tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts],
                  **columns, trainer_state=TrainerState(), log_extra=_no_op, log_metric=_no_op)
    for i, func in enumerate(funcs):
        if isinstance(func, (str, nn.Module)):
            continue
        name = names[i] if names else getattr(func, "__name__", repr(func))
        try:
            output = func(**kwargs)
            if inspect.isawaitable(output):  # TRL awaits async reward functions
                output = asyncio.run(output)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(exc).__name__}: {_short(exc)} on a dry batch of {len(rows)} "
                "rows; fix it before training") from None
        if (problem := _problem(output, len(rows))) is not None:
            raise RewardFunctionError(f"reward function {name!r} {problem} on a dry batch of {len(rows)} rows; a "
                                      "reward function returns one float (or None) per completion")
