"""The tool world's study: GRPO and POISE with tools on, 3 seeds each at equal generated tokens, held-out success
before and after with `poise compare`'s intervals, tool calls per rollout, and the tools-off baseline.

Builds the world's model (`poise toy build --world toolworld`, seed 0) into --world (./tiny-qwen3-toolworld, as
the recipes name it) unless it is there, runs `poise compare` on recipes/toy/grpo_toolworld.yaml and
recipes/toy/poise_toolworld.yaml (one compare process per recipe, side by side: the machine's two cores),
aggregates them with `--aggregate-only`, and writes OUTPUT/study.json beside compare.json. The tools-off baseline
is the same model on each seed's held-out questions with no tools (recipes/toy/grpo_toolworld_no_tools.yaml's
evaluation), sampled as the runs' evaluations sample.

    python benchmarks/toolworld_study.py [--budget-tokens 60000] [--seeds 3] [-o benchmarks/results/compare_toolworld]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from poise_trl.core.provenance import package_versions, write_json
from poise_trl.run.recipe import load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {name: ROOT / "recipes" / "toy" / f"{name}.yaml" for name in ("grpo_toolworld", "poise_toolworld")}
BASELINE = ROOT / "recipes" / "toy" / "grpo_toolworld_no_tools.yaml"


def build_world(folder: Path) -> dict:
    """The world in two supervised stages of 100 steps (seed 0 from the toy-arith model, then seed 1 from it, each
    with fresh conversations): after the first, the model still miscopies most keys (docs/studies.md)."""
    first = folder.with_name(folder.name + "-stage1")
    for out, seed, base in ((first, 0, None), (folder, 1, first)):
        if not (out / "build_info.json").exists():
            from poise_trl.run.toy import build_toolworld_model  # noqa: PLC0415 (torch loads only to build)

            build_toolworld_model(out, seed=seed, base_dir=base, progress=False)
    return {f"stage{stage}": json.loads((out / "build_info.json").read_text()) for stage, out in ((1, first),
                                                                                                 (2, folder))}


def compare(recipes: list[Path], args, model: Path, aggregate_only: bool = False) -> list[str]:
    return [sys.executable, "-m", "poise_trl.cli.main", "compare", *map(str, recipes),
            "--budget-tokens", str(args.budget_tokens), "--seeds", str(args.seeds), "--eval-points",
            str(args.eval_points), "-o", str(args.output), "--set", f"model={model}", "--no-progress",
            *(["--aggregate-only"] if aggregate_only else [])]


def tools_off(model: Path, seeds: int) -> dict:
    """Held-out success of the model with no tools, on each seed's held-out questions, as a run evaluates."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from poise_trl.engines.generation import TransformersEngine, evaluate_accuracy  # noqa: PLC0415
    from poise_trl.run.build import load_datasets  # noqa: PLC0415
    from poise_trl.run.toy import toolworld_tokenizer  # noqa: PLC0415

    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(model), toolworld_tokenizer(), batch_size=128)
    by_seed = {}
    for seed in range(seeds):
        settings = parse_recipe(load_recipe(BASELINE, [f"model={model}", f"seed={seed}"])).settings
        _, eval_set = load_datasets(settings, seed)
        by_seed[seed] = evaluate_accuracy(engine, eval_set, num_samples=settings.eval_num_samples, temperature=1.0,
                                          max_new_tokens=settings.eval_max_new_tokens, seed=seed)["accuracy"]
    return {"recipe": str(BASELINE.relative_to(ROOT)), "by_seed": by_seed,
            "mean": statistics.fmean(by_seed.values())}


def tool_use(folder: Path, batch: int) -> dict:
    """Tool calls, errors and turns per training rollout, over a run's logged steps."""
    log = json.loads((folder / "summary.json").read_text())["train_log"]
    steps = [entry for entry in log if "tools/calls" in entry]
    return {"calls_per_rollout": statistics.fmean(e["tools/calls"] / batch for e in steps),
            "calls_per_rollout_first_step": steps[0]["tools/calls"] / batch,
            "calls_per_rollout_last_step": steps[-1]["tools/calls"] / batch,
            "errors_per_rollout": statistics.fmean(e["tools/errors"] / batch for e in steps),
            "turns_per_rollout": statistics.fmean(e["tools/turns_per_rollout"] for e in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-tokens", type=int, default=60000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-points", type=int, default=2)
    parser.add_argument("--world", type=Path, default=Path("tiny-qwen3-toolworld"))
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "benchmarks" / "results" / "compare_toolworld")
    args = parser.parse_args()
    started = time.time()
    model = args.world.resolve()
    world = build_world(model)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    running = [subprocess.Popen(compare([recipe], args, model), env=environment) for recipe in RECIPES.values()]
    if any(process.wait() for process in running):
        sys.exit("a compare run failed (its output is above); rerun the same command to resume")
    subprocess.run(compare(list(RECIPES.values()), args, model, aggregate_only=True), env=environment, check=True)
    report = json.loads((args.output / "compare.json").read_text())
    batch = {name: load_recipe(path)["per_device_train_batch_size"] for name, path in RECIPES.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    payload = {
        "command": "python benchmarks/toolworld_study.py " + " ".join(sys.argv[1:]),
        "code_version": commit.stdout.strip(),
        "config": vars(args) | {"output": str(args.output.relative_to(ROOT)), "world": str(args.world), "recipes": {
            name: str(path.relative_to(ROOT)) for name, path in RECIPES.items()}},
        "world": {stage: {key: card[key] for key in ("sft", "build_seconds", "train_seconds", "base_model",
                                                     "heldout_sampled_accuracy", "heldout_accuracy_without_tools")}
                  for stage, card in world.items()},
        "tools_off_baseline": tools_off(model, args.seeds),
        "tool_use": {name: {seed: tool_use(args.output / "runs" / name / f"seed{seed}", batch[name])
                            for seed in range(args.seeds)} for name in RECIPES},
        "rise": {name: report["differences"][f"{name} - start"]["final"] for name in RECIPES},
        "final_accuracy": {name: report["results"][name]["final_accuracy"] for name in RECIPES},
        "start_accuracy": {name: report["results"][name]["start_accuracy"] for name in RECIPES},
        "poise_minus_grpo": report["differences"]["poise_toolworld - grpo_toolworld"]["final"],
        "study_seconds": round(time.time() - started, 1),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "note": "2 shared CPU cores (other engineers' jobs ran beside it), 1 torch thread a run, no GPU"},
        "versions": package_versions(),
    }
    write_json(args.output / "study.json", payload)
    print(json.dumps({key: payload[key] for key in ("tools_off_baseline", "rise", "poise_minus_grpo")}, indent=1))


if __name__ == "__main__":
    main()
