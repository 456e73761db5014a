"""The tool world's study: GRPO and POISE with tools on, 3 seeds each at equal generated tokens, held-out success
before and after with `poise compare`'s intervals, tool calls per rollout, and the tools-off baseline.

Builds the world's model (`poise toy build --world toolworld`, seed 0) into --world (./tiny-qwen3-toolworld, as
the recipes name it) unless it is there, runs `poise compare` on recipes/toy/grpo_toolworld.yaml and
recipes/toy/poise_toolworld.yaml (one compare process per recipe, side by side: the machine's two cores),
aggregates them with `--aggregate-only`, and writes OUTPUT/study.json beside compare.json. The tools-off baseline
is the same model on each seed's held-out questions with no tools (recipes/toy/grpo_toolworld_no_tools.yaml's
evaluation), sampled as the runs' evaluations sample.

    python benchmarks/toolworld_study.py [--budget-tokens 200000] [--seeds 3] [-o benchmarks/results/compare_toolworld]
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
from poise_trl.run.recipe import load_recipe, parse_recipe, tool_limits

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {name: ROOT / "recipes" / "toy" / f"{name}.yaml" for name in ("grpo_toolworld", "poise_toolworld")}
BASELINE = ROOT / "recipes" / "toy" / "grpo_toolworld_no_tools.yaml"


def build_world(folder: Path, stages: int) -> dict:
    """The world in `stages` supervised stages of 100 steps, each a build of its own (seed 0 from the toy-arith
    model, then seed k from stage k), so that each stage's card holds its held-out success (docs/studies.md)."""
    outs = [folder.with_name(f"{folder.name}-stage{k}") for k in range(1, stages)] + [folder]
    cards = {}
    for seed, out in enumerate(outs):
        if not (out / "build_info.json").exists():
            from poise_trl.run.toy import build_toolworld_model  # noqa: PLC0415 (torch loads only to build)

            build_toolworld_model(out, seed=seed, base_dir=outs[seed - 1] if seed else None, stages=1,
                                  progress=False)
        cards[f"stage{seed + 1}"] = json.loads((out / "build_info.json").read_text())
    return cards


def compare(recipes: list[Path], args, model: Path, aggregate_only: bool = False) -> list[str]:
    return [sys.executable, "-m", "poise_trl.cli.main", "compare", *map(str, recipes),
            "--budget-tokens", str(args.budget_tokens), "--seeds", str(args.seeds), "--eval-points",
            str(args.eval_points), "-o", str(args.output), "--set", f"model={model}", "--no-progress",
            *(["--aggregate-only"] if aggregate_only else [])]


def held_out(model: Path, seeds: int, recipe: Path) -> dict:
    """Held-out success of the model on each seed's held-out questions as a run of `recipe` evaluates it (with its
    environment's tools when it has one): the start of that recipe's runs."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from poise_trl.engines.generation import TransformersEngine, evaluate_accuracy  # noqa: PLC0415
    from poise_trl.evaluation.agent import AgentEngine, RecipeTools, Toolbox  # noqa: PLC0415
    from poise_trl.run.build import load_datasets  # noqa: PLC0415
    from poise_trl.run.callbacks import HELD_OUT_CONVERSATIONS  # noqa: PLC0415
    from poise_trl.run.toy import toolworld_tokenizer  # noqa: PLC0415

    tokenizer = toolworld_tokenizer()
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(model), tokenizer, batch_size=128)
    plan = parse_recipe(load_recipe(recipe, [f"model={model}"]))
    settings = plan.settings
    toolbox = settings.environment and Toolbox(tokenizer, RecipeTools(**tool_limits(plan.recipe)))
    by_seed = {}
    for seed in range(seeds):
        _, eval_set = load_datasets(settings, seed)
        sampler = toolbox and AgentEngine(engine, toolbox, eval_set.to_list(), chunk=HELD_OUT_CONVERSATIONS)
        by_seed[seed] = evaluate_accuracy(sampler or engine, eval_set, num_samples=settings.eval_num_samples,
                                          temperature=1.0, max_new_tokens=settings.eval_max_new_tokens,
                                          seed=seed)["accuracy"]
    if toolbox:
        toolbox.close()
    return {"recipe": str(recipe.relative_to(ROOT)), "by_seed": by_seed, "mean": statistics.fmean(by_seed.values())}


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
    parser.add_argument("--budget-tokens", type=int, default=200000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-points", type=int, default=2)
    parser.add_argument("--world", type=Path, default=Path("tiny-qwen3-toolworld"))
    parser.add_argument("--stages", type=int, default=3, help="supervised stages of the world's build")
    parser.add_argument("--build-only", action="store_true", help="build and evaluate the world; no training")
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "benchmarks" / "results" / "compare_toolworld")
    args = parser.parse_args()
    started = time.time()
    model = args.world.resolve()
    world = build_world(model, args.stages)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    provenance = {"code_version": commit.stdout.strip(), "versions": package_versions(), "machine": {
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "note": "2 shared CPU cores (other engineers' jobs ran beside it), 1-2 torch threads, no GPU"}}
    worlds = {stage: {**{key: card[key] for key in ("sft", "build_seconds", "train_seconds", "base_model")},
                      "held_out_with_tools": card["heldout_sampled_accuracy"]["accuracy"],  # each stage's card
                      "held_out_without_tools": card["heldout_accuracy_without_tools"]["accuracy"]}
              for stage, card in world.items()}
    start = {"tools_off_baseline": held_out(model, args.seeds, BASELINE)}  # with tools: the runs' own start
    if args.build_only:
        start["with_tools"] = held_out(model, args.seeds, RECIPES["grpo_toolworld"])
    if args.build_only:  # the world's held-out success before any training, and nothing else
        payload = {"command": "python benchmarks/toolworld_study.py " + " ".join(sys.argv[1:]), "world": worlds,
                   "held_out_before_training": start, **provenance}
        write_json(args.output.with_name(args.output.name + "_build.json"), payload)
        print(json.dumps(start, indent=1))
        return
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    running = [subprocess.Popen(compare([recipe], args, model), env=environment) for recipe in RECIPES.values()]
    if any(process.wait() for process in running):
        sys.exit("a compare run failed (its output is above); rerun the same command to resume")
    subprocess.run(compare(list(RECIPES.values()), args, model, aggregate_only=True), env=environment, check=True)
    report = json.loads((args.output / "compare.json").read_text())
    batch = {name: load_recipe(path)["per_device_train_batch_size"] for name, path in RECIPES.items()}
    payload = {
        "command": "python benchmarks/toolworld_study.py " + " ".join(sys.argv[1:]),
        "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        | {"output": str(args.output.relative_to(ROOT)),
           "recipes": {name: str(path.relative_to(ROOT)) for name, path in RECIPES.items()}},
        "world": worlds,
        "held_out_before_training": start,
        "tool_use": {name: {seed: tool_use(args.output / "runs" / name / f"seed{seed}", batch[name])
                            for seed in range(args.seeds)} for name in RECIPES},
        "rise": {name: report["differences"][f"{name} - start"]["final"] for name in RECIPES},
        "final_accuracy": {name: report["results"][name]["final_accuracy"] for name in RECIPES},
        "start_accuracy": {name: report["results"][name]["start_accuracy"] for name in RECIPES},
        "grpo_minus_poise": report["differences"]["grpo_toolworld - poise_toolworld"]["final"],
        "study_seconds": round(time.time() - started, 1),
        **provenance,
    }
    write_json(args.output / "study.json", payload)
    print(json.dumps({key: payload[key] for key in ("held_out_before_training", "rise", "grpo_minus_poise")},
                     indent=1))


if __name__ == "__main__":
    main()
