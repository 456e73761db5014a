"""Time to refusal: the seconds `poise` takes to refuse bad input (a missing recipe, a bad override, a bad
`--gpus`, an unknown shipped recipe), each a fresh process as a user runs it, against the import of torch and
TRL alone (what a refusal used to wait for), in interleaved rounds on the same machine.

The goal (issue 51) is a refusal in under 2 s on an idle machine; the load average before and after is recorded
because the machine this runs on is often shared.

    python benchmarks/time_to_refusal.py [--rounds 5] [--output benchmarks/results/time_to_refusal.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from poise_trl.core.provenance import package_versions, write_json

REPO = Path(__file__).resolve().parents[1]
POISE = [sys.executable, "-m", "poise_trl.cli.main"]
CASES = {
    "missing recipe file": [*POISE, "train", "no_such_recipe.yaml"],
    "override out of range (max_steps=0)": [*POISE, "train", "recipes/toy/poise.yaml", "max_steps=0"],
    "plan --gpus 0": [*POISE, "plan", "recipes/gpu/poise_qwen3-4b.yaml", "--gpus", "0"],
    "recipe key gpus=-1": [*POISE, "plan", "recipes/gpu/poise_qwen3-4b.yaml", "gpus=-1"],
    "unknown shipped recipe (recipes cp poisee)": [*POISE, "recipes", "cp", "poisee"],
}
BASELINE = ("import torch and trl (what a refusal waited for before)", [sys.executable, "-c", "import torch, trl"])


def timed(command: list[str], refusal: bool) -> float:
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - start
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    if refusal and (run.returncode != 2 or len(errors) != 1):
        raise RuntimeError(f"{command}: exit {run.returncode}, not one error line: {run.stderr[-500:]}")
    return seconds


def code_version() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "poise_trl", "benchmarks/time_to_refusal.py")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/time_to_refusal.json")
    args = parser.parse_args()

    load_before = os.getloadavg()
    commands = {**{name: (command, True) for name, command in CASES.items()},
                BASELINE[0]: (BASELINE[1], False)}
    seconds = {name: [] for name in commands}
    names = list(commands)
    for round_index in range(args.rounds):  # each round in another order, so no case always runs first
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            seconds[name].append(timed(*commands[name]))
    baseline = statistics.median(seconds[BASELINE[0]])
    results = {name: {"median_s": statistics.median(values), "rounds_s": values,
                      "share_of_torch_trl_import": statistics.median(values) / baseline}
               for name, values in seconds.items()}
    payload = {
        "command": "python " + " ".join(sys.argv),
        "setting": "each command a fresh `python -m poise_trl.cli.main` process from the repository root, "
                   "HF_HUB_OFFLINE=1; every refusal checked to exit 2 with one `error:` line",
        "code_version": code_version(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "versions": package_versions(),
        "slowest_refusal_median_s": max(results[name]["median_s"] for name in CASES),
        "results": results,
    }
    write_json(args.output, payload)
    for name, result in results.items():
        print(f"{result['median_s']:6.2f} s  {name}")


if __name__ == "__main__":
    main()
