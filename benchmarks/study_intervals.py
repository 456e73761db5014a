"""Paired differences of final held-out accuracy, with 95% intervals, for the committed `poise compare`
studies that kept only compare.json (no run summaries: no per-prompt results, no standard errors).

Each pair of arms is compared seed by seed (`poise_trl.run.compare.paired_difference`): the seeds are redrawn,
and each final evaluation gets a normal draw whose standard error is the binomial bound
sqrt(p (1 - p) / prompts), the most an Avg@k over that many prompts can have. The intervals therefore err
wide; a difference they resolve is resolved. Studies with run summaries get exact intervals from
`poise compare --aggregate-only` instead.

    python benchmarks/study_intervals.py [--output benchmarks/results/study_intervals.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
from pathlib import Path

from poise_trl.core.provenance import package_versions, write_json
from poise_trl.run.compare import paired_difference
from poise_trl.tasks import load_prompt_dataset

RESULTS = Path(__file__).resolve().parent / "results"
STUDIES = ("compare_toy_study", "compare_spread", "compare_toy", "compare_process_rewards_grpo",
           "compare_process_rewards_rloo")


def seed_curves(result: dict, prompts: int) -> list[list[dict]]:
    """Per seed: the start (the same policy and draw for every arm: no noise in the difference), the end."""
    start = result["start_accuracy"]
    return [[{"step": 0, "accuracy": start, "stderr": 0.0},
             {"step": 1, "accuracy": run["final_accuracy"],
              "stderr": math.sqrt(run["final_accuracy"] * (1 - run["final_accuracy"]) / prompts)}]
            for run in sorted(result["runs"], key=lambda run: run["seed"])]


def study_intervals(study: str) -> dict:
    report = json.loads((RESULTS / study / "compare.json").read_text())
    recipe = next(iter(report["recipes"].values()))["recipe"]
    prompts = len(load_prompt_dataset(recipe["dataset"], split="test", limit=recipe.get("eval_limit")))
    out = {"held_out_prompts": prompts, "seeds": report["seeds"], "final_accuracy_differences": {}}
    for first, second in itertools.combinations(report["results"], 2):
        difference = paired_difference(seed_curves(report["results"][first], prompts),
                                       seed_curves(report["results"][second], prompts))
        out["final_accuracy_differences"][f"{first} - {second}"] = difference["final"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(RESULTS / "study_intervals.json"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = commit.stdout.strip()
    payload = {"command": "python benchmarks/study_intervals.py", "code_version": commit,
               "method": __doc__.split("\n\n")[1].replace("\n", " "),
               "studies": {study: study_intervals(study) for study in STUDIES},
               "versions": package_versions()}
    write_json(Path(args.output), payload)
    for study, record in payload["studies"].items():
        pairs = record["final_accuracy_differences"]
        resolved = {pair: d for pair, d in pairs.items() if d["resolved"]}
        print(f"{study}: {len(resolved)} of {len(pairs)} pairs resolved")
        for pair, d in resolved.items():
            print(f"  {pair}: {d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")


if __name__ == "__main__":
    main()
