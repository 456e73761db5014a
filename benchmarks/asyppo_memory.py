"""Peak memory and step time of AsyPPO's mini-critics against PPO's same-size critic.

The AsyPPO paper (arXiv 2510.01656, computational efficiency) reports that AsyPPO's asymmetric
critics cut the step time and peak GPU memory of symmetric PPO. This measures the same on one machine: each recipe runs
`--steps` optimizer steps in a FRESH subprocess (so one run's allocations never count
toward another's), built by `build_run` as `poise train` builds it, with no checkpoints and the
held-out evaluation it adds at the start and end cut to one prompt and one token, and reports

- peak memory: on a GPU `torch.cuda.max_memory_allocated`; on a CPU the growth of the
  process's peak resident set (`resource.getrusage(...).ru_maxrss`) from just before the
  run is built (data, models) to the end of training (`peak_rss_delta_mb`; the imports' own
  footprint is excluded), and the absolute peak;
- the median and mean step wall time, the first step excluded (one-off allocations), and
  the part of it spent in the critics (scoring every row, then the fit), which is where the
  two settings differ;
- actor and critic parameter counts.

CPU workers run with `--threads` torch threads (default 1): on a machine shared with other
jobs, more threads than free cores make step times meaningless.

Defaults: recipes/toy/asyppo.yaml (2 mini-critics from data/tiny-critic) vs recipes/toy/ppo.yaml
(1 critic the size of the actor), plus recipes/toy/grpo.yaml (no critic) as the floor;
all three generate 64 completions per step.

    python benchmarks/asyppo_memory.py [--steps 8] [--recipes A.yaml B.yaml ...] [--override key=value ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = ["recipes/toy/asyppo.yaml", "recipes/toy/ppo.yaml", "recipes/toy/grpo.yaml"]
RESULT_MARKER = "ASYPPO_MEMORY_RESULT "


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(recipe_path: str, steps: int, overrides: list[str], threads: int) -> dict:
    """One measurement, run inside its own process."""
    import torch

    torch.set_num_threads(threads)
    from transformers import TrainerCallback

    from poise_trl.run.build import build_run
    from poise_trl.run.recipe import load_recipe

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    recipe = load_recipe(REPO / recipe_path, overrides)
    recipe.update(max_steps=steps, logging_steps=steps, save_strategy="no", eval_every=0, eval_limit=1,
                  eval_num_samples=1, eval_max_new_tokens=1, eval_batch_size=1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before_models = peak_rss_mb()
    built = build_run(recipe, tempfile.mkdtemp(prefix="asyppo_memory_"))
    trainer, args = built.trainer, built.parsed.args
    after_models = peak_rss_mb()
    timer = StepTimer()
    trainer.add_callback(timer)
    critics = getattr(trainer, "critics", None)
    critic_seconds = []
    if critics is not None:
        for name in ("values", "update"):
            method = getattr(critics, name)

            def timed(*a, _method=method, **k):
                start = time.perf_counter()
                out = _method(*a, **k)
                critic_seconds.append(time.perf_counter() - start)
                return out

            setattr(critics, name, timed)
    trainer.train()
    measured = timer.times[1:]
    result = {
        "recipe": recipe_path,
        "algo": recipe["algo"],
        "critic_model": getattr(args, "critic_model", None),
        "num_critics": len(critics) if critics is not None else 0,
        "actor_parameters": sum(p.numel() for p in trainer.model.parameters()),
        "critic_parameters": critics.num_parameters if critics is not None else 0,
        "steps": steps,
        "median_step_seconds": round(statistics.median(measured), 4),
        "mean_step_seconds": round(statistics.mean(measured), 4),
        # values + update once per step (steps_per_generation = 1), the first step excluded
        "critic_seconds_per_step": round(sum(critic_seconds[2:]) / max(steps - 1, 1), 4),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch_threads": torch.get_num_threads(),
    }
    if cuda:
        result["peak_gpu_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    result.update(
        peak_rss_mb=round(peak_rss_mb(), 1),
        peak_rss_delta_mb=round(peak_rss_mb() - before_models, 1),
        models_rss_delta_mb=round(after_models - before_models, 1),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    parser.add_argument("--override", nargs="*", default=[], help="key=value applied to every recipe")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU worker")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "asyppo_memory.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        print(RESULT_MARKER + json.dumps(worker(cli.worker, cli.steps, cli.override, cli.threads)), flush=True)
        return

    from poise_trl.core.provenance import package_versions, write_json

    runs = []
    for recipe in cli.recipes:
        cmd = [sys.executable, __file__, "--worker", recipe, "--steps", str(cli.steps), "--threads", str(cli.threads),
               "--override", *cli.override]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
        if proc.returncode or not lines:
            sys.exit(f"{recipe} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        runs.append(json.loads(lines[-1][len(RESULT_MARKER):]))
    by_algo = {run["algo"]: run for run in runs}
    summary = {"runs": runs, "versions": package_versions()}
    if "asyppo" in by_algo and "ppo" in by_algo:
        asy, ppo = by_algo["asyppo"], by_algo["ppo"]
        memory_key = "peak_gpu_memory_mb" if "peak_gpu_memory_mb" in asy else "peak_rss_delta_mb"
        summary["asyppo_vs_ppo"] = {
            "memory_metric": memory_key,
            "memory_ratio": round(asy[memory_key] / ppo[memory_key], 3),
            "step_time_ratio": round(asy["median_step_seconds"] / ppo["median_step_seconds"], 3),
            "critic_time_ratio": round(asy["critic_seconds_per_step"] / ppo["critic_seconds_per_step"], 3),
            "critic_parameter_ratio": round(asy["critic_parameters"] / ppo["critic_parameters"], 3),
        }
    write_json(Path(cli.output), summary)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
