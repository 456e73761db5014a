"""Accuracy of our grader, and of math-verify alone, on the answer-equivalence suite, by source.

The suite (tests/fixtures/grader/cases.jsonl) holds (prediction, gold, expected, source) cases. External
suites, each case quoted from a named file: math-verify's own tests (huggingface/Math-Verify tests/), the
MATH grader's `is_equiv` tests (hendrycks/math modeling/math_equivalence_test.py), Qwen2.5-Math's grader
examples (evaluation/grader.py) and Minerva's few-shot solutions (lm-evaluation-harness minerva_math).
The project's own cases (source `own: ...`: built on golds of public evaluation files, or exercising one
normalisation rule) are reported apart, so that they cannot inflate the external numbers. "math-verify
alone" is its documented use: `verify(parse(gold), parse(prediction))`, a bare gold wrapped in `$...$`.
Also times the fast path and a stuck grade cut at its timeout. Writes the JSON named by --output (a path
relative to the repository) and prints the table.

    python benchmarks/grader_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

from math_verify import parse, verify

from poise_trl.core.provenance import package_versions, write_json
from poise_trl.tasks.math_grader import grade_batch, is_correct

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "fixtures" / "grader" / "cases.jsonl"


def load_cases(path: Path = CASES) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


EXTERNAL_SUITES = ("math-verify", "MATH", "Qwen2.5-Math", "Minerva")
OWN = "own"


def source_group(source: str) -> str:
    """The suite a case comes from: the first word of its source (`math-verify tests/...` -> math-verify,
    `own: ...` -> own)."""
    return source.split()[0].rstrip(":")


def groups_of(case: dict) -> list[str]:
    """Every row of the table that counts `case`: its suite, external or own, all, and its expected verdict."""
    group = source_group(case["source"])
    origin = "external (all suites)" if group in EXTERNAL_SUITES else OWN
    verdict = "expected equal" if case["expected"] else "expected not equal"
    return list(dict.fromkeys([group, origin, "all", verdict]))


def math_verify_alone(prediction: str, gold: str) -> bool:
    wrapped = gold if any(mark in gold for mark in ("$", "\\boxed", "\\(", "\\[")) else f"${gold}$"
    try:
        return bool(verify(parse(wrapped), parse(prediction)))
    except Exception:  # math-verify raises on a few inputs; a raise is a failed grade
        return False


def timings(calls: int = 200) -> dict:
    """The fast path (one grade per call, as `poise bench` does) and a stuck grade cut at its timeout in a
    thread (as a reward called from a trainer thread): `(9999^{9999})^{9999}` would run for minutes."""
    is_correct(r"\boxed{1}", 1)  # starts the worker (and its spare)
    start = time.monotonic()
    for _ in range(calls):
        is_correct(r"\boxed{\frac{140}{2}}", 70)
    per_call = (time.monotonic() - start) / calls
    stuck: list[float] = []

    def grade_stuck() -> None:
        begin = time.monotonic()
        grade_batch([(r"\boxed{(9999^{9999})^{9999}}", 70)], timeout_seconds=1.0)
        stuck.append(time.monotonic() - begin)

    worker = threading.Thread(target=grade_stuck)
    worker.start()
    worker.join()
    return {"fast_path_ms_per_call": 1000 * per_call, "stuck_grade_seconds_at_timeout_1s": stuck[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/results/grader_accuracy.json",
                        help="where to write the JSON, relative to the repository root")
    args = parser.parse_args()

    cases = load_cases()
    start = time.monotonic()
    ours = grade_batch([(case["prediction"], case["gold"]) for case in cases])
    ours_seconds = time.monotonic() - start
    start = time.monotonic()
    alone = [math_verify_alone(case["prediction"], case["gold"]) for case in cases]
    alone_seconds = time.monotonic() - start

    by_group: dict[str, dict[str, list[bool]]] = defaultdict(lambda: {"ours": [], "math_verify": []})
    for case, our, theirs in zip(cases, ours, alone, strict=True):
        for group in groups_of(case):
            by_group[group]["ours"].append(our == case["expected"])
            by_group[group]["math_verify"].append(theirs == case["expected"])
    rank = {name: i for i, name in enumerate([*EXTERNAL_SUITES, "external (all suites)", OWN, "all"])}
    table = {
        group: {"cases": len(hits["ours"]), **{who: sum(h) / len(h) for who, h in hits.items()}}
        for group, hits in sorted(by_group.items(), key=lambda item: rank.get(item[0], len(rank)))
    }
    failures = [
        {**case, "ours": our} for case, our in zip(cases, ours, strict=True) if our != case["expected"]
    ]
    print(f"{'source':<22} {'cases':>5} {'ours':>7} {'math-verify':>12}")
    for group, row in table.items():
        print(f"{group:<22} {row['cases']:>5} {row['ours']:>7.3f} {row['math_verify']:>12.3f}")
    print(f"grading time: ours {ours_seconds:.1f} s, math-verify alone {alone_seconds:.1f} s, {len(cases)} cases")
    timing = timings()
    print(f"fast path {timing['fast_path_ms_per_call']:.2f} ms per is_correct call; a stuck grade in a thread "
          f"returned after {timing['stuck_grade_seconds_at_timeout_1s']:.2f} s at timeout_seconds=1")
    for failure in failures:
        print(f"  ours wrong: expected {failure['expected']}: gold {failure['gold'][:60]!r}, "
              f"prediction {failure['prediction'][-60:]!r} ({failure['source']})")
    write_json(REPO / args.output, {
        "command": "python benchmarks/grader_accuracy.py",
        "suite": str(CASES.relative_to(REPO)),
        "accuracy": table,
        "seconds": {"ours": ours_seconds, "math_verify": alone_seconds},
        "timings": timing,
        "our_failures": failures,
        "versions": package_versions(),
    })


if __name__ == "__main__":
    main()
