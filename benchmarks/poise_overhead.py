"""POISE's cost over GRPO with the same 2 rollouts per prompt on the same batches.

Measures, on the bundled tiny model and toy-arith, for each setting:
- the mean per-step wall time of POISE and of GRPO (num_generations=2), and their ratio
  (goal: <= 1.10 on the toy model);
- policy forward passes per step for both (goal: equal when TRL already runs a no-grad
  pass, i.e. `num_iterations > 1` or vLLM with importance-sampling correction).

    python benchmarks/poise_overhead.py [--steps 12] [--output benchmarks/results/poise_overhead.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from poise_trl.build import build_run
from poise_trl.loading import resolve_model_path
from poise_trl.provenance import package_versions, write_json

# build_run evaluates held-out accuracy at the start and the end of every run, outside the timed
# steps: one prompt, one token.
MINIMAL_EVAL = {"eval_every": 0, "eval_limit": 1, "eval_num_samples": 1, "eval_max_new_tokens": 1, "eval_batch_size": 1}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run(algo: str, model: str, steps: int, num_iterations: int, out: Path) -> dict:
    recipe = {
        "algo": algo, "model": model, "dataset": "toy-arith", "dataset_size": 2048, "seed": 0,
        "num_generations": 2, "per_device_train_batch_size": 64, "max_completion_length": 96,
        "learning_rate": 1e-4, "max_steps": steps, "num_iterations": num_iterations, "logging_steps": steps,
        "save_strategy": "no", "beta": 0.0, "scale_rewards": "none", "rewards": ["math_accuracy"], **MINIMAL_EVAL,
    }
    if algo == "poise":
        recipe.update(probe_bootstrap_steps=2, probe_prompt_components=16, probe_response_components=32,
                      probe_buffer_rows=1024, probe_ridge_alpha=10.0)
    # grpo: TRL's trainer plus the pass counter
    trainer = build_run(recipe, str(out / f"{algo}-it{num_iterations}"), overwrite=True).trainer
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    measured = timer.times[1:]  # the first step pays one-off costs (allocations, caches)
    return {
        "algo": algo,
        "num_iterations": num_iterations,
        "steps": steps,
        "mean_step_seconds": statistics.mean(measured),
        "median_step_seconds": statistics.median(measured),
        "policy_forward_passes_per_step": trainer.policy_forward_passes / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/tiny-qwen3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output", default="benchmarks/results/poise_overhead.json")
    parser.add_argument("--workdir", default="runs/bench_poise_overhead")
    cli = parser.parse_args()
    model = resolve_model_path(cli.model)
    results = []
    for num_iterations in (1, 2):
        grpo = run("grpo", model, cli.steps, num_iterations, Path(cli.workdir))
        poise = run("poise", model, cli.steps, num_iterations, Path(cli.workdir))
        results.append({
            "num_iterations": num_iterations,
            "trl_runs_no_grad_pass": num_iterations > 1,
            "grpo": grpo,
            "poise": poise,
            "wall_time_ratio_poise_over_grpo": poise["median_step_seconds"] / grpo["median_step_seconds"],
            "forward_passes_equal": poise["policy_forward_passes_per_step"] == grpo["policy_forward_passes_per_step"],
        })
        print(f"num_iterations={num_iterations}: step time POISE {poise['median_step_seconds']:.3f}s vs GRPO "
              f"{grpo['median_step_seconds']:.3f}s (ratio {results[-1]['wall_time_ratio_poise_over_grpo']:.3f}); "
              f"policy forward passes per step {poise['policy_forward_passes_per_step']:.2f} vs "
              f"{grpo['policy_forward_passes_per_step']:.2f}")
    payload = {"model": cli.model, "goal_ratio_at_most": 1.10, "results": results, "versions": package_versions()}
    write_json(cli.output, payload)
    print(f"wrote {cli.output}")


if __name__ == "__main__":
    main()
