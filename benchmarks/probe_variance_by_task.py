"""The POISE probe's variance reduction per task, per arm and over training, from a `poise compare` study's
run summaries: a probe per task against one shared probe.

Each POISE run logs, every step on a task mix, `probe/<task>/variance_reduction`: 1 - Var(r - b) / Var(r) over
that task's rows of the step (the rows the probe gave baselines; a task whose rewards in the step are all
equal logs nothing). Only steps where the probe gave the baselines count (the pooled `probe/variance_reduction`
of `poise compare` counts the same steps). Per arm and task: the mean over a seed's steps, then over seeds,
with a 95% bootstrap interval that redraws the seeds and, within each, its steps (and the same for the pooled
`probe/variance_reduction` of those steps, as "all tasks": it also counts the spread between tasks' mean
rewards, which a task's own figure does not); the same means in equal
slices of the token budget (the per-step curve); and for each pair of arms the difference, seeds paired.

    python benchmarks/probe_variance_by_task.py RUNS --arms poise_multitask poise_shared_multitask
        [--slices 5] [--output benchmarks/results/probe_variance_by_task.json]

RUNS is a study's `runs/` folder (`RUNS/<arm>/seed<N>/summary.json`); seeds missing the per-task entries (runs
made before POISE logged them) are listed under `seeds_without_per_task_entries` and left out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from poise_trl.core.provenance import package_versions, write_json
from poise_trl.run.compare import aggregate_bins, binned

SAMPLES = 4000
PREFIX, SUFFIX = "probe/", "/variance_reduction"
POOLED, POOLED_KEY = "all tasks", "probe/variance_reduction"


def per_task_series(train_log: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{task: [(generated tokens, variance reduction)]} over the steps where the probe gave the baselines."""
    series: dict[str, list[tuple[float, float]]] = {}
    for entry in train_log:
        if entry.get("probe/mae") is None:  # bootstrap steps: RLOO's baselines, not the probe's
            continue
        by_task = {key[len(PREFIX):-len(SUFFIX)]: value for key, value in entry.items()
                   if key.startswith(PREFIX) and key.endswith(SUFFIX) and key != POOLED_KEY}
        for task, value in by_task.items():
            series.setdefault(task, []).append((entry["generated_tokens"], value))
        if by_task:  # the step's pooled figure beside its tasks' (between-task spread counts in it)
            series.setdefault(POOLED, []).append((entry["generated_tokens"], entry[POOLED_KEY]))
    return series


def bootstrap(rng: np.random.Generator, first: list[np.ndarray], second: list[np.ndarray] | None = None) -> np.ndarray:
    """Means over seeds of the seeds' step means (of first - second, seeds paired, where `second` is given),
    redrawing seeds (the same indices for both arms) and then steps within each run."""
    out = np.empty(SAMPLES)
    for i in range(SAMPLES):
        seeds = rng.integers(len(first), size=len(first))
        out[i] = np.mean([rng.choice(first[s], size=len(first[s])).mean()
                          - (0.0 if second is None else rng.choice(second[s], size=len(second[s])).mean())
                          for s in seeds])
    return out


def interval(point: float, draws: np.ndarray) -> dict:
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"mean": round(float(point), 4), "ci95": [round(float(low), 4), round(float(high), 4)],
            "resolved": bool(low > 0 or high < 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="a poise compare study's runs/ folder")
    parser.add_argument("--arms", nargs="+", required=True, help="POISE recipes' run names (folders under RUNS)")
    parser.add_argument("--slices", type=int, default=5, help="equal slices of the token budget for the curve")
    parser.add_argument("--output", default="benchmarks/results/probe_variance_by_task.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    series, skipped = {}, {}
    for arm in args.arms:
        folders = sorted((args.runs / arm).glob("seed*/summary.json"))
        if not folders:
            sys.exit(f"error: no {args.runs / arm}/seed*/summary.json: give a compare study's runs/ folder and "
                     "the POISE arms' run names")
        series[arm] = {}
        for path in folders:
            summary = json.loads(path.read_text())
            found = per_task_series(summary["train_log"])
            if not found:
                skipped.setdefault(arm, []).append(path.parent.name)
                continue
            budget = summary["budget"]["amount"]
            series[arm][path.parent.name] = (found, budget)

    arms = {}
    for arm, runs in series.items():
        tasks = sorted({task for found, _ in runs.values() for task in found})
        arms[arm] = {"seeds": sorted(runs), "by_task": {}}
        for task in tasks:
            per_seed = [np.array([v for _, v in found[task]]) for found, _ in runs.values() if task in found]
            curve = [None if piece["mean"] is None else round(piece["mean"], 4) for piece in aggregate_bins(
                [binned(found.get(task, []), budget, args.slices) for found, budget in runs.values()])]
            point = float(np.mean([s.mean() for s in per_seed]))
            arms[arm]["by_task"][task] = {**interval(point, bootstrap(rng, per_seed)),
                                          "steps_per_seed": [len(s) for s in per_seed], "by_budget_slice": curve}

    differences = {}
    for first, second in itertools.combinations(series, 2):
        seeds = sorted(set(series[first]) & set(series[second]))  # paired: only seeds both arms logged
        if not seeds:
            continue
        for task in sorted(set(arms[first]["by_task"]) & set(arms[second]["by_task"])):
            a = [np.array([v for _, v in series[first][s][0][task]]) for s in seeds]
            b = [np.array([v for _, v in series[second][s][0][task]]) for s in seeds]
            point = float(np.mean([x.mean() - y.mean() for x, y in zip(a, b, strict=True)]))
            differences.setdefault(f"{first} - {second}", {})[task] = {
                **interval(point, bootstrap(rng, a, b)), "seeds": seeds}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    payload = {"command": "python benchmarks/probe_variance_by_task.py " + " ".join(sys.argv[1:]),
               "code_version": commit, "method": __doc__.split("\n\n")[1].replace("\n", " "),
               "seeds_without_per_task_entries": skipped, "arms": arms, "differences": differences,
               "versions": package_versions()}
    write_json(Path(args.output), payload)
    for arm, result in arms.items():
        for task, stats in result["by_task"].items():
            low, high = stats["ci95"]
            print(f"{arm:28s} {task:36s} {stats['mean']:+.3f} [{low:+.3f}, {high:+.3f}]")
    for pair, by_task in differences.items():
        for task, stats in by_task.items():
            low, high = stats["ci95"]
            verdict = "resolved" if stats["resolved"] else "not resolved"
            print(f"{pair:52s} {task:36s} {stats['mean']:+.3f} [{low:+.3f}, {high:+.3f}] {verdict}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
