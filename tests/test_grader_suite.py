"""The grader on a suite of answer-equivalence cases (tests/fixtures/grader/cases.jsonl).

Each case is (prediction, gold, expected, source). External cases quote a named file: math-verify's own
tests (huggingface/Math-Verify tests/, default configuration), the MATH grader's `is_equiv` tests
(hendrycks/math modeling/math_equivalence_test.py), the examples in Qwen2.5-Math's grader
(evaluation/grader.py `_test_math_equal`, commented out there, so the labels are ours) and Minerva's
few-shot solutions (lm-evaluation-harness lm_eval/tasks/minerva_math/utils.py). The project's own cases
have a source starting `own:`: built on golds of public evaluation files (named with their row), or
exercising one rule of Minerva's answer normalisation. Three math-verify cases are left out: two whose
label holds only with its expression extraction switched off, and one recording a quirk (`1 - 1/e` equal
to `1 + 1/e`). `benchmarks/grader_accuracy.py` prints the accuracy per source, next to math-verify alone.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from poise_trl.tasks.math_grader import grade_batch

CASES = Path(__file__).parent / "fixtures" / "grader" / "cases.jsonl"
# Each external suite, and the file its cases quote.
EXTERNAL_SUITES = {
    "math-verify": "math-verify tests/test_",
    "MATH": "MATH modeling/math_equivalence_test.py::test_",
    "Qwen2.5-Math": "Qwen2.5-Math evaluation/grader.py::_test_math_equal",
    "Minerva": "Minerva few-shot (lm-evaluation-harness lm_eval/tasks/minerva_math/utils.py list_fewshot_samples)",
}


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def test_each_case_is_external_with_its_file_named_or_our_own(cases):
    assert all(set(case) == {"prediction", "gold", "expected", "source"} for case in cases)
    assert all(isinstance(case["expected"], bool) for case in cases)
    suites = Counter(case["source"].split()[0] for case in cases)
    assert set(suites) == {*EXTERNAL_SUITES, "own:"}, suites
    for case in cases:
        suite = case["source"].split()[0]
        assert suite == "own:" or case["source"].startswith(EXTERNAL_SUITES[suite]), case["source"]
    assert sum(suites[suite] for suite in EXTERNAL_SUITES) >= 280  # external cases alone
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
