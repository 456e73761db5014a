"""The grader on a suite of public answer-equivalence cases (tests/fixtures/grader/cases.jsonl).

Each case is (prediction, gold, expected, source): math-verify's own tests (huggingface/Math-Verify
tests/, default configuration), the MATH grader's `is_equiv` tests (hendrycks/math), Qwen2.5-Math's grader
examples (evaluation/grader.py), Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D, as in
lm-evaluation-harness minerva_math), and cases constructed on golds copied from public evaluation files
(Qwen2.5-Math evaluation/data). Three math-verify cases are left out: two whose label holds only with its
expression extraction switched off, and one recording a quirk (`1 - 1/e` equal to `1 + 1/e`).
`benchmarks/grader_accuracy.py` prints the same accuracy per source, next to math-verify alone.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from poise_trl.rewards import grade_batch

CASES = Path(__file__).parent / "fixtures" / "grader" / "cases.jsonl"
PUBLIC_SUITES = ("math-verify", "MATH", "Qwen2.5-Math", "Minerva")


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def test_the_suite_is_public_and_two_sided(cases):
    assert len(cases) >= 300
    assert all(set(case) == {"prediction", "gold", "expected", "source"} for case in cases)
    assert all(isinstance(case["expected"], bool) and case["source"].strip() for case in cases)
    suites = Counter(case["source"].split()[0] for case in cases)
    assert all(suites[suite] > 0 for suite in PUBLIC_SUITES), suites
    assert sum(suites[suite] for suite in PUBLIC_SUITES) >= 300  # public cases alone, not the constructed ones
    expected = Counter(case["expected"] for case in cases)
    assert expected[True] >= 100 and expected[False] >= 50, expected


def test_grader_accuracy_on_the_suite(cases):
    grades = grade_batch([(case["prediction"], case["gold"]) for case in cases])
    failures = [
        f"expected {case['expected']}: gold {case['gold'][:80]!r} prediction {case['prediction'][-80:]!r} "
        f"({case['source']})"
        for case, grade in zip(cases, grades, strict=True)
        if grade != case["expected"]
    ]
    accuracy = 1 - len(failures) / len(cases)
    assert accuracy >= 0.98, f"accuracy {accuracy:.3f}; failures:\n" + "\n".join(failures)
