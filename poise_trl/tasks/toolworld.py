"""`toolworld`: a question about a hidden table that takes two dependent tool calls to answer.

Each row hides a table of four three-digit keys and two-digit values (in its verifier, never in its prompt) and
asks "What is the value of key KEY plus K?". Its environment (`ToolWorld`, one instance per rollout, TRL's
`environment_factory` style) answers `lookup(key)` from the row's table and `add(a, b)`: the answer is right when
the looked-up value fed the sum. Each row draws its own table, so no held-out answer is in any training row, and
held-out rows come from another random stream (a run drops any held-out question a training row asks). Scored on
the final `<answer>...</answer>`. Details: docs/tasks.md.
"""

from __future__ import annotations

import json
import random

from poise_trl.tasks.family import TaskError, TaskFamily, extract_tagged_answer

TABLE_SIZE = 4
DEFAULT_SIZE = {"train": 2000, "test": 200}


def make_row(rng: random.Random, split: str, index: int) -> dict:
    keys: set[str] = set()
    while len(keys) < TABLE_SIZE:  # digits: the toy-arith model copies them, and 300 SFT steps did not teach letters
        keys.add(str(rng.randint(100, 999)))
    table = {key: rng.randint(10, 99) for key in sorted(keys)}
    key, addend = rng.choice(sorted(table)), rng.randint(10, 99)
    return {"id": f"toolworld/{split}/{index}",
            "prompt": [{"role": "user", "content": f"What is the value of key {key} plus {addend}?"}],
            "answer": table[key] + addend,
            "verifier": {"answer": table[key] + addend, "table": table, "key": key, "addend": addend}}


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    if variant is not None:
        raise TaskError(f"task toolworld has no variants; give toolworld, not toolworld:{variant}")
    if split not in DEFAULT_SIZE:
        raise TaskError(f"unknown split {split!r} for toolworld; use 'train' or 'test'")
    rng = random.Random(f"toolworld/{split}/{seed}")
    return [make_row(rng, split, index) for index in range(size or DEFAULT_SIZE[split])]


def score(completion: str, verifier: dict) -> float:
    return float(extract_tagged_answer(completion) == str(verifier["answer"]))


class ToolWorld:
    """One rollout's tools: `lookup` reads the row's hidden table, `add` sums; `calls` records what was called."""

    def reset(self, **row) -> None:
        self.table = json.loads(row["verifier"])["table"]
        self.calls: list[list] = []

    def lookup(self, key: str) -> int:
        """The value stored under a key.

        Args:
            key: The key.
        """
        self.calls.append(["lookup", key])
        if key not in self.table:
            raise KeyError(f"no key {key}")
        return self.table[key]

    def add(self, a: int, b: int) -> int:
        """The sum of two integers.

        Args:
            a: An integer.
            b: An integer.
        """
        self.calls.append(["add", a, b])
        return int(a) + int(b)


def tool_call(name: str, **arguments) -> str:
    """A call as the model writes it (Qwen3's format, which TRL's response parser reads)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _slipped(value: int, rate: float, rng: random.Random | None) -> int:
    return value + rng.choice((-1, 1)) if rng is not None and rng.random() < rate else value


def solution(verifier: dict, slip_rate: float = 0.0, rng: random.Random | None = None) -> list[tuple[str, str | None]]:
    """The model's turns, each with the tool's result that follows it: `lookup(key)`, `add(value, addend)`, the
    answer. With `slip_rate`, each number copied from a result or the question is off by one at that rate (and the
    rest follows from the slip), so a model taught on it makes the slips that RL is there to remove."""
    value = verifier["table"][verifier["key"]]
    a, b = _slipped(value, slip_rate, rng), _slipped(verifier["addend"], slip_rate, rng)
    return [(tool_call("lookup", key=verifier["key"]), str(value)), (tool_call("add", a=a, b=b), str(a + b)),
            (f"<answer>{_slipped(a + b, slip_rate, rng)}</answer>", None)]


TASK = TaskFamily(
    name="toolworld",
    description="a hidden table's value plus a number: lookup(key) then add(a, b) in the environment "
                "poise_trl.tasks.toolworld:ToolWorld",
    answer_format="<answer>...</answer>",
    build_rows=build_rows,
    score=score,
)
