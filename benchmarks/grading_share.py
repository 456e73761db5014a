"""Grading's share of a training step, per task: the seconds a POISE step spends in its reward functions
(TRL's `_calculate_rewards`: math-verify in its worker, a reasoning-gym verifier, BFCL's AST check, IFEval's
checkers, HumanEval's tests in the sandbox) against the whole step, on the bundled tiny model with 16
prompts x 2 rollouts and 64 new tokens per step.

The tiny model writes no working code, tool call or tagged answer: its completions are graded fast (a junk
program fails at once, a completion without `<answer>` scores 0 unread), and real steps (a GPU forward and
backward of a large model) cost far more. So the benchmark also grades each task's gold completions (the
row's answer in the task's format: a boxed number, an `<answer>`, BFCL's calls, HumanEval's canonical solution
whose tests run in the sandbox; IFEval rows hold no gold response) outside training: that per-rollout time is
what carries over to another model.

    python benchmarks/grading_share.py [--steps 4] [--output benchmarks/results/grading_share.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from poise_trl.algorithms.poise import POISETrainer
from poise_trl.core import sandbox
from poise_trl.core.provenance import package_versions, write_json
from poise_trl.run.build import build_run
from poise_trl.run.recipe import parse_recipe
from poise_trl.tasks import is_task, load_prompt_dataset, score_rows

TASKS = ("toy-arith", "reasoning-gym:leg_counting", "bfcl", "ifeval", "humaneval")
RESULTS = Path(__file__).resolve().parent / "results"


class TimedRewardsTrainer(POISETrainer):
    """POISE with the wall time of each call of its reward functions recorded."""

    reward_seconds: list[float]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        started = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.reward_seconds.append(time.perf_counter() - started)
        return rewards


def measure(task: str, steps: int, workdir: Path) -> dict:
    recipe = {"algo": "poise", "model": "data/tiny-qwen3", "dataset": task, "seed": 0, "num_generations": 2,
              "per_device_train_batch_size": 32, "max_completion_length": 64, "learning_rate": 2e-4, "beta": 0.0,
              "max_steps": steps, "logging_steps": 1, "save_steps": 10_000, "probe_prompt_components": 4,
              "probe_response_components": 8, "probe_bootstrap_steps": 1, "eval_every": 0, "eval_limit": 1}
    if task != "toy-arith":
        recipe["dataset_size"] = 16 * steps
    run = build_run(parse_recipe(recipe, str(workdir / task.replace(":", "-"))), overwrite=True,
                    trainer_class=TimedRewardsTrainer)
    trainer = run.trainer
    trainer.reward_seconds = []
    trainer.train()
    step_seconds = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    # The first step includes warm-ups (math-verify's worker start, a family's first import): left out.
    grading, stepping = trainer.reward_seconds[1:], step_seconds[1:]
    rollouts = trainer.generated_rollouts // steps
    return {
        "task": task,
        "steps_measured": len(stepping),
        "rollouts_per_step": rollouts,
        "median_step_seconds": statistics.median(stepping),
        "median_grading_seconds": statistics.median(grading),
        "grading_share_of_step": sum(grading) / sum(stepping),
        "grading_ms_per_rollout": 1000 * statistics.median(grading) / rollouts,
    }


def gold_completion(task: str, answer: str) -> str | None:
    """The row's gold in the form its verifier reads, or None where the row holds no gold response."""
    if not is_task(task):
        return f"<think>\n</think>\n\\boxed{{{answer}}}"
    family = task.split(":")[0]
    return {"reasoning-gym": f"<answer>{answer}</answer>", "bfcl": answer,
            "humaneval": f"```python\n{answer}\n```"}.get(family)


def gold_grading(task: str, rollouts: int, repeats: int = 3) -> dict | None:
    """Median seconds to grade `rollouts` gold completions of `task` (one batch, as a step grades them)."""
    rows = load_prompt_dataset(task, split="test", limit=rollouts, seed=0)
    texts = [gold_completion(task, answer) for answer in rows["answer"]]
    if any(text is None for text in texts):
        return None
    tasks = rows["task"] if "task" in rows.column_names else None
    seconds, rewards = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        if tasks is None:
            from poise_trl.tasks.rewards import math_accuracy_reward

            rewards = math_accuracy_reward(texts, answer=rows["answer"])
        else:
            rewards = score_rows(texts, tasks, rows["verifier"])
        seconds.append(time.perf_counter() - started)
    return {"rollouts": len(texts), "mean_reward": sum(rewards) / len(rewards),
            "grading_ms_per_rollout": 1000 * statistics.median(seconds) / len(texts)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "grading_share.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        results = []
        for task in TASKS:
            results.append(measure(task, args.steps, Path(workdir)))
            results[-1]["gold_completions"] = gold_grading(task, results[-1]["rollouts_per_step"])
            print(results[-1], flush=True)
    write_json(args.output, {
        "command": "python benchmarks/grading_share.py" + (f" --steps {args.steps}" if args.steps != 4 else ""),
        "setting": "POISE on data/tiny-qwen3, 16 prompts x 2 rollouts per step, 64 new tokens, transformers "
                   "generation; the first step (warm-ups) left out",
        "isolation": sandbox.detect_isolation(),
        "results": results,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "note": "2 cores shared with other jobs, no GPU"},
        "versions": package_versions(),
    })


if __name__ == "__main__":
    main()
