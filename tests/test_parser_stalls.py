"""Verifiers a completion cannot stall: every family scores 0, within its time limit, on 1 MB of garbage,
JSON nested 100,000 deep, a million `<tool_call>` tags, invalid UTF-8 and a completion of only
whitespace. (A lazy regex over unclosed tags, or `^\\s*` at every line of a whitespace answer, took
minutes here before.)"""

import time

import pytest

from poise_trl.core import sandbox
from poise_trl.tasks import score_rows, task_rows
from poise_trl.tasks.humaneval import DEFAULT_TIMEOUT_S
from poise_trl.tasks.math_grader import GRADE_TIMEOUT_S

UNBOUNDED_LIMIT_S = 2.0  # for verifiers without a time limit of their own: pure parsing, no excuse to be slow
LIMITS_S = {"math:toy-arith": GRADE_TIMEOUT_S, "humaneval": DEFAULT_TIMEOUT_S + sandbox.KILL_MARGIN_S,
            "reasoning-gym:leg_counting": UNBOUNDED_LIMIT_S, "bfcl": UNBOUNDED_LIMIT_S,
            "ifeval": UNBOUNDED_LIMIT_S}
STALLERS = {
    "garbage_1mb": lambda: "".join(chr(33 + (i * 7919) % 90) for i in range(2**20)),
    "json_nested_100k": lambda: ("<answer>" + "[" * 100_000 + "]" * 100_000 + "</answer><tool_call>"
                                 + '{"a":' * 100_000 + "1" + "}" * 100_000 + "</tool_call>"),
    "million_tool_call_tags": lambda: "<tool_call>" * 1_000_000,
    "invalid_utf8": lambda: (b"\xff\xfe\xc3\x28\xa0\xa1\xed\xa0\x80" * 100_000).decode("utf-8",
                                                                                 "surrogateescape"),
    "only_whitespace": lambda: " \n\t\r\v\f" * 100_000,
}


@pytest.fixture(scope="module")
def verifiers():
    """One row's verifier per task, each verifier warmed up once (worker start, imports) off the clock."""
    if sandbox.detect_isolation() == "none":
        pytest.skip("neither bubblewrap nor unshare isolates here")
    rows = {name: task_rows(name, "test", 1, 0)[0]["verifier"] for name in LIMITS_S}
    for name, verifier in rows.items():
        score_rows(["warm-up"], [name], [verifier])
    return rows


@pytest.mark.parametrize("staller", STALLERS)
@pytest.mark.parametrize("task", LIMITS_S)
def test_a_verifier_cannot_be_stalled(task, staller, verifiers):
    text = STALLERS[staller]()
    start = time.monotonic()
    assert score_rows([text], [task], [verifiers[task]]) == [0.0]
    assert time.monotonic() - start < LIMITS_S[task]
