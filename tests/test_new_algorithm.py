"""An algorithm added from this file alone: a trainer with side state kept across rounds and checkpoints,
a report file, a memory-plan item, a summary field and a `poise compare` series, all declared in its
registration. It trains end to end through `train_from_recipe` (what `poise train` runs) with no edit to
the package: build, train, the run folder, the plan and compare read the declaration."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import VARYING_REWARD
from trl import GRPOConfig

from poise_trl.algorithms import algorithms
from poise_trl.algorithms.base import ALGORITHMS, RunCallback, Signal, logged, register_algorithm
from poise_trl.core.provenance import write_json
from poise_trl.run.compare import log_series
from poise_trl.run.plan import plan_recipe
from poise_trl.run.recipe import parse_recipe
from poise_trl.run.train import train_from_recipe
from poise_trl.seam.grpo import GRPOSeam

NAME = "running_mean"
STATE_FILE = "running_mean.json"
REPORT_FILE = "baseline_report.json"


@dataclass
class RunningMeanConfig(GRPOConfig):
    """GRPOConfig plus the baseline's decay; 2 rollouts per prompt, no std division."""

    num_generations: int | None = field(default=2, metadata={"help": "Rollouts per prompt."})
    scale_rewards: str = field(default="none", metadata={"help": "No std division."})
    baseline_decay: float = field(default=0.5, metadata={"help": "Weight of the old baseline per update."})


class RunningMeanTrainer(GRPOSeam):
    """A = r - b, with b a running mean of the rewards of earlier rounds: state that outlives a round, so it
    goes into every checkpoint (`save_side_state`) and comes back on resume (`load_side_state`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.baseline = 0.0
        self.baseline_history: list[dict] = []

    def compute_advantages(self, rewards, output):
        advantages = rewards - self.baseline
        self.baseline_history.append({"step": self.state.global_step, "baseline": self.baseline})
        decay = self.args.baseline_decay
        self.baseline = decay * self.baseline + (1 - decay) * rewards.mean().item()
        self.log_metric("running_mean/baseline", self.baseline)
        return self.local_rows(advantages)

    def save_side_state(self, checkpoint: Path) -> None:
        write_json(checkpoint / STATE_FILE, {"baseline": self.baseline, "history": self.baseline_history})

    def load_side_state(self, checkpoint: Path) -> None:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        self.baseline, self.baseline_history = state["baseline"], state["history"]


class BaselineReport(RunCallback):
    """At the end of training: the baseline of every round, into the run folder and the summary."""

    report: dict | None = None

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            history = self.trainer.baseline_history
            self.report = {"rounds": len(history), "final_baseline": self.trainer.baseline}
            write_json(Path(self.output_dir) / REPORT_FILE, {**self.report, "history": history})

    def summary(self) -> dict:
        return {} if self.report is None else {NAME: self.report}


def baseline_memory(value, plan) -> list[tuple[str, int, str]]:
    rows = int(value("per_device_train_batch_size"))
    return [("running-mean baseline", 8 * rows, f"one float64 per row, {rows} rows")]


@pytest.fixture
def registered():
    register_algorithm(NAME, RunningMeanConfig, RunningMeanTrainer, "Running mean", "A = r - past rewards' mean",
                       card="Running mean: baseline from earlier rounds' rewards",
                       callbacks=(BaselineReport,), run_files=(REPORT_FILE,), memory_items=baseline_memory,
                       signals={"running_mean/baseline": Signal("running-mean baseline", "baseline",
                                                                logged("running_mean/baseline"))})
    yield
    del ALGORITHMS[NAME]


def recipe(model_dir) -> dict:
    return {"algo": NAME, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 16,
            "eval_limit": 4, "eval_every": 0, "eval_num_samples": 1, "eval_max_new_tokens": 8,
            "per_device_train_batch_size": 4, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
            "save_steps": 1, "learning_rate": 1e-3,
            "seed": 0, "rewards": [VARYING_REWARD], "baseline_decay": 0.25}


def test_the_declaration_reaches_the_recipe_and_the_memory_plan(registered, tiny_random_model_dir):
    assert NAME in algorithms()
    plan = parse_recipe(recipe(tiny_random_model_dir))
    assert plan.args.baseline_decay == 0.25 and plan.args.num_generations == 2  # its config, the recipe's
    items = {item.name: item for item in plan_recipe(plan, device="cpu").items}
    assert items["running-mean baseline"].bytes == 8 * 4


def test_a_new_algorithm_trains_end_to_end_with_its_state_report_and_summary(registered, tmp_path,
                                                                             tiny_random_model_dir):
    out = tmp_path / "run"
    summary = train_from_recipe(recipe(tiny_random_model_dir), str(out), show_progress=False)
    assert summary["algo"] == NAME and summary["steps"] == 2
    report = json.loads((out / REPORT_FILE).read_text())
    assert summary[NAME] == {"rounds": 2, "final_baseline": report["final_baseline"]}
    assert [h["step"] for h in report["history"]] == [0, 1]
    assert json.loads((out / "checkpoint-1" / STATE_FILE).read_text())["history"] == report["history"][:1]
    assert "Running mean: baseline" in (out / "final" / "README.md").read_text()
    baselines = log_series(summary["train_log"], "running_mean/baseline")
    assert [value for _, value in baselines] == pytest.approx([h["baseline"] for h in report["history"][1:]]
                                                              + [report["final_baseline"]])

    # The report file counts as the run's own: the finished run is found, not refused as foreign files.
    again = train_from_recipe(recipe(tiny_random_model_dir), str(out), show_progress=False)
    assert again["already_finished"]

    # A kill after checkpoint-1: the rerun resumes from it and its report covers both rounds, the first from
    # the state that came back with the checkpoint.
    shutil.rmtree(out / "checkpoint-2")
    for name in ("summary.json", REPORT_FILE):
        (out / name).unlink()
    resumed = train_from_recipe(recipe(tiny_random_model_dir), str(out), show_progress=False)
    assert resumed["resumed_at_steps"] == [1]
    assert resumed[NAME]["rounds"] == 2
    assert json.loads((out / REPORT_FILE).read_text())["history"][0] == report["history"][0]
