"""DAPO's generation overhead from dynamic sampling on the toy task.

Trains recipes/toy/dapo.yaml (bundled tiny model) for --steps steps and records, per step,
the generation rounds and the groups generated, informative (rewards not all equal),
dropped and trained; then the same steps with dynamic sampling off (--no-compare skips it),
so the wall-clock cost of the extra rounds is measured, not only counted. `train_seconds` is the
time inside optimizer steps (generation included, the held-out evaluation `build_run` adds at the
start and end, cut here to one prompt and one token, left out). Writes
benchmarks/results/dapo_dynamic_sampling.json and prints a summary.

    OMP_NUM_THREADS=1 python benchmarks/dapo_dynamic_sampling.py --steps 20

Timings on a CPU shared with other jobs are only comparable with one thread per process:
with more, OpenMP's spinning threads make every op several times slower under load (5x at
a load average of 4 on 2 cores, measured), and that load changes between the two runs.
The rollout counts do not depend on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from poise_trl.algorithms.dapo import DAPOTrainer  # noqa: E402
from poise_trl.core.loading import resolve_model_path  # noqa: E402
from poise_trl.core.provenance import package_versions, write_json  # noqa: E402
from poise_trl.run.build import build_run  # noqa: E402
from poise_trl.run.recipe import (
    load_recipe,  # noqa: E402
    parse_recipe,  # noqa: E402
)

REPO = Path(__file__).resolve().parents[1]
# build_run evaluates held-out accuracy at the start and the end of every run: one prompt, one token.
MINIMAL_EVAL = {"eval_every": 0, "eval_limit": 1, "eval_num_samples": 1, "eval_max_new_tokens": 1,
                "eval_batch_size": 1}


def repo_relative(path: str | Path) -> str:
    """The path as the artefact records it: relative to the repository when inside it, so a committed
    artefact names no folder of the machine it ran on."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


class TimedDAPOTrainer(DAPOTrainer):
    """Adds up the wall-clock time of every generation phase (all rounds of a step)."""

    generation_seconds = 0.0

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.generation_seconds += time.perf_counter() - started
        return output


def run(recipe: dict, steps: int, output_dir: Path, dynamic: bool) -> dict:
    recipe = {**recipe, "max_steps": steps, "save_strategy": "no", "logging_steps": steps, "dynamic_sampling": dynamic,
              **MINIMAL_EVAL}
    built = build_run(parse_recipe(recipe, str(output_dir)), overwrite=True, trainer_class=TimedDAPOTrainer)
    trainer, args = built.trainer, built.parsed.args
    trainer.train()
    result = {"dynamic_sampling": dynamic, "steps": steps,
              "train_seconds": round(built.eval_callback.train_seconds, 2),
              "generation_seconds": round(trainer.generation_seconds, 2)}
    history = trainer.dynamic_sampling_history
    if history:
        total = {key: sum(r[key] for r in history) for key in history[0] if key not in ("step", "rounds")}
        rounds = [r["rounds"] for r in history]
        result.update(
            generated_rollouts=total["generated_rollouts"],
            trained_rollouts=total["trained_rollouts"],
            generated_per_trained=round(total["generated_rollouts"] / total["trained_rollouts"], 3),
            mean_rounds=round(statistics.mean(rounds), 3),
            rounds_histogram={str(k): v for k, v in sorted(Counter(rounds).items())},
            cap_hits=sum(r == args.max_generation_rounds for r in rounds),
            first_round_informative_fraction=round(
                total["first_round_informative"] / (len(history) * history[0]["trained_groups"]), 3),
            informative_fraction=round(total["informative_groups"] / total["generated_groups"], 3),
            dropped_groups=total["dropped_groups"],
            zero_weight_groups=total["zero_weight_groups"],
            zero_variance_trained=total["zero_variance_trained"],
            per_step=history,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "toy" / "dapo.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compare", action="store_true", help="Skip the run without dynamic sampling.")
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "dapo_dynamic_sampling.json")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "bench_dapo_dynamic_sampling"))
    cli = parser.parse_args()

    recipe = load_recipe(cli.recipe)
    if not Path(resolve_model_path(recipe["model"])).exists():
        raise SystemExit(f"model {recipe['model']} not found: build the bundled model first (poise toy build)")
    dynamic = run(recipe, cli.steps, Path(cli.work_dir) / "dynamic", dynamic=True)
    report = {"recipe": repo_relative(cli.recipe), "model": recipe["model"], "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "dynamic": dynamic, "versions": package_versions()}
    if not cli.no_compare:
        plain = run(recipe, cli.steps, Path(cli.work_dir) / "plain", dynamic=False)
        report["no_dynamic"] = plain
        report["generation_time_ratio"] = round(dynamic["generation_seconds"] / plain["generation_seconds"], 3)
        report["train_time_ratio"] = round(dynamic["train_seconds"] / plain["train_seconds"], 3)
    write_json(cli.output, report)

    print(f"DAPO dynamic sampling, {cli.steps} steps of {cli.recipe}:")
    print(f"  rollouts generated / trained: {dynamic['generated_rollouts']} / {dynamic['trained_rollouts']} "
          f"= {dynamic['generated_per_trained']}x")
    print(f"  informative groups: {dynamic['first_round_informative_fraction']:.1%} of a step's first round, "
          f"{dynamic['informative_fraction']:.1%} of all generated")
    print(f"  rounds per step: mean {dynamic['mean_rounds']}, histogram {dynamic['rounds_histogram']}, "
          f"cap hit {dynamic['cap_hits']}x; groups left out of the loss to keep the batch shape "
          f"{dynamic['zero_weight_groups']}, zero-variance trained {dynamic['zero_variance_trained']}")
    if "no_dynamic" in report:
        plain = report["no_dynamic"]
        print(f"  generation time: {dynamic['generation_seconds']} s vs {plain['generation_seconds']} s without "
              f"dynamic sampling ({report['generation_time_ratio']}x); whole run {dynamic['train_seconds']} s vs "
              f"{plain['train_seconds']} s ({report['train_time_ratio']}x)")
    print(f"  written to {cli.output}")


if __name__ == "__main__":
    main()
