"""`toy-arith`: integer additions in words with graded difficulty (level = digits per operand, 1-4).

`toy-arith-spread` adds levels 5 and 6, which the tiny model never solves, so prompt difficulty varies as
much as in a real math set. The worked solution adds column by column with an explicit carry inside
`<think>...</think>` before `\\boxed{answer}`.
"""

from __future__ import annotations

import random

LEVELS = (1, 2, 3, 4)  # toy-arith, the levels the tiny model is taught
SPREAD_LEVELS = (1, 2, 3, 4, 5, 6)  # toy-arith-spread
MAX_LEVEL = 9

_TEMPLATES = (
    "What is {a} plus {b}?",
    "Compute the sum of {a} and {b}.",
    "Add {a} and {b}.",
    "What do you get when you add {a} to {b}?",
)


def make_problem(rng: random.Random, level: int) -> dict:
    """One problem of `level` digits per operand: {question, answer, level, a, b}."""
    if not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"toy-arith level must be between 1 and {MAX_LEVEL} digits, got {level}")
    low = 0 if level == 1 else 10 ** (level - 1)
    a, b = rng.randint(low, 10**level - 1), rng.randint(low, 10**level - 1)
    question = rng.choice(_TEMPLATES).format(a=a, b=b)
    return {"question": question, "answer": str(a + b), "level": level, "a": a, "b": b}


def generate_problems(n: int, seed: int, levels: tuple[int, ...] = LEVELS) -> list[dict]:
    """`n` problems, levels in round-robin so every level is equally represented."""
    rng = random.Random(seed)
    return [make_problem(rng, levels[i % len(levels)]) for i in range(n)]


def generate_spread_problems(n: int, seed: int) -> list[dict]:
    """`n` toy-arith-spread problems: levels 1-6 in round-robin."""
    return generate_problems(n, seed, SPREAD_LEVELS)


def worked_solution(a: int, b: int, slip_rate: float = 0.0, rng: random.Random | None = None) -> tuple[str, int]:
    """The scratchpad, one line per column right to left (`x+y+carry=s`), and the answer it arrives at.

    With probability `slip_rate` a column is off by one and the rest follows from the slip, so a model taught
    on it makes the slips RL is there to remove.
    """
    xs, ys = str(a)[::-1], str(b)[::-1]
    lines, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        if slip_rate and rng is not None and rng.random() < slip_rate:
            total = total + 1 if total == 0 or rng.random() < 0.5 else total - 1
        lines.append(f"{x}+{y}+{carry}={total}")
        digits.append(total % 10)
        carry = total // 10
    result = int(str(carry) + "".join(str(d) for d in reversed(digits)))
    lines.append(f"so {a}+{b}={result}")
    return "\n".join(lines), result


def assistant_response(a: int, b: int, slip_rate: float = 0.0, rng: random.Random | None = None) -> str:
    scratchpad, result = worked_solution(a, b, slip_rate, rng)
    return f"<think>\n{scratchpad}\n</think>\n\\boxed{{{result}}}"
