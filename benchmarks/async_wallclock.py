"""Wall-clock per 10k generated tokens, synchronous vs asynchronous (`async: true`), for GRPO and POISE.

Both arms train the same toy recipe (`recipes/toy/{grpo,poise}.yaml`, shrunk by the options below) against
the same vLLM CPU server, started here once, and differ only in `async`: the synchronous arm is TRL's
GRPOTrainer in server mode (`use_vllm: true, vllm_mode: server`), the asynchronous one TRL's
AsyncGRPOTrainer with `max_staleness`. Server and arms run under `taskset -c CORES`, each arm a fresh
process; the arms of a pair run one after the other, the order alternating from pair to pair. Timed: from
the end of step `--warmup` to the end of the last step (the asynchronous worker's spawn and the first syncs
are not counted), over the completion tokens generated in between (the asynchronous arm counts every
rollout it pulls from the worker, stale ones dropped included), and over the completion tokens trained on
(TRL's `batch/trained_tokens_per_step`; the synchronous arm trains on all it generates). Per pair the ratio
async / sync of seconds per 10k tokens, both ways; per algorithm the geometric mean ratio with a 95%
bootstrap interval over pairs.

    python benchmarks/async_wallclock.py [--pairs 5] [--steps 8] [--warmup 2] [--algos grpo poise]
        [--cores 0,1] [--prompts 8] [--completion-length 48] [--max-staleness 1]
        [--output benchmarks/results/async_wallclock.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def arm_recipe(algo: str, asynchronous: bool, args, url: str, seed: int) -> dict:
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / "toy" / f"{algo}.yaml").read_text())
    generations = recipe["num_generations"]
    recipe.update(model=str(ROOT / "poise_trl" / "data" / "tiny-qwen3"), seed=seed, max_steps=args.steps,
                  per_device_train_batch_size=args.prompts * generations,
                  max_completion_length=args.completion_length, eval_every=0, eval_limit=8, eval_num_samples=1,
                  eval_max_new_tokens=8, save_strategy="no", logging_steps=1, vllm_server_base_url=url)
    if asynchronous:
        recipe.update({"async": True, "max_staleness": args.max_staleness})
    else:
        recipe.update(use_vllm=True, vllm_mode="server")
    return recipe


def run_arm(recipe: dict, warmup: int) -> dict:
    """In the arm's process: train, and time steps warmup+1.. against the tokens generated meanwhile."""
    from transformers import TrainerCallback

    from poise_trl.run.build import build_run
    from poise_trl.run.recipe import parse_recipe

    marks = []

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), trainer.generated_tokens))

    with tempfile.TemporaryDirectory() as out:
        trainer = build_run(parse_recipe(recipe, out), overwrite=True).trainer
        trainer.add_callback(Marks())
        trainer.train()
    (t0, tokens0), (t1, tokens1) = marks[warmup - 1], marks[-1]
    # The synchronous arm trains on every token it generates; the asynchronous one drops stale groups.
    trained = sum(entry.get("batch/trained_tokens_per_step", 0) for entry in trainer.state.log_history
                  if entry.get("step", 0) > warmup) if recipe.get("async") else tokens1 - tokens0
    timed = [entry for entry in trainer.state.log_history if entry.get("step", 0) > warmup and "loss" in entry]
    # Where the asynchronous arm's time goes (TRL's own gauges): waiting for rollouts, syncing weights, staleness.
    gauges = sorted({key for entry in timed for key in entry if key.startswith(("perf/", "sample/"))})
    return {"gauges_mean": {key: float(np.mean([entry[key] for entry in timed if key in entry])) for key in gauges},
            "seconds": t1 - t0, "generated_tokens": tokens1 - tokens0, "trained_tokens": trained,
            "steps_timed": len(marks) - warmup, "seconds_per_10k_generated": (t1 - t0) / (tokens1 - tokens0) * 1e4,
            "seconds_per_10k_trained": (t1 - t0) / trained * 1e4}


def arm_process(recipe: dict, warmup: int, cores: str) -> dict:
    command = ["taskset", "-c", cores, sys.executable, __file__, "--arm", json.dumps(recipe), "--warmup",
               str(warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def code_version() -> str:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    changed = git("status", "--porcelain", "--", "poise_trl", "benchmarks/async_wallclock.py")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")


def geometric_mean_interval(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> dict:
    logs = np.log(np.asarray(ratios))
    draws = np.random.default_rng(seed).choice(logs, size=(resamples, len(logs))).mean(axis=1)
    low, high = np.quantile(draws, [0.025, 0.975])
    return {"ratio": math.exp(logs.mean()), "ci95": [math.exp(low), math.exp(high)]}


def summary(pairs: list[dict]) -> dict:
    """Per algorithm: the two ratios with intervals, and where the asynchronous arm's time and tokens went (means
    over pairs of each arm's step seconds, TRL's wait for rollouts, and the share of generated tokens dropped as
    stale)."""
    mean = lambda values: float(np.mean(list(values)))  # noqa: E731
    return {"per_10k_generated": geometric_mean_interval([p["ratio_generated"] for p in pairs]),
            "per_10k_trained": geometric_mean_interval([p["ratio_trained"] for p in pairs]),
            "sync_step_seconds": mean(p["sync"]["seconds"] / p["sync"]["steps_timed"] for p in pairs),
            "async_step_seconds": mean(p["async"]["seconds"] / p["async"]["steps_timed"] for p in pairs),
            "async_rollout_wait_seconds": mean(p["async"]["gauges_mean"]["perf/rollout_wait_s"] for p in pairs),
            "async_generated_share_dropped": mean(1 - p["async"]["trained_tokens"] / p["async"]["generated_tokens"]
                                                  for p in pairs),
            "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm"), parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5), parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--algos", nargs="+", default=["grpo", "poise"])
    parser.add_argument("--cores", default="0,1"), parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=48)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "async_wallclock.json"))
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(json.loads(args.arm), args.warmup)))
        return

    from poise_trl.core.provenance import package_versions, write_json
    from poise_trl.engines.vllm_server import LocalServer

    model = ROOT / "poise_trl" / "data" / "tiny-qwen3"
    results = {algo: [] for algo in args.algos}
    os.sched_setaffinity(0, {int(core) for core in args.cores.split(",")})  # the server inherits the cores
    with tempfile.TemporaryDirectory() as logs:
        server = LocalServer(model, Path(logs) / "server.log")
        server.start()
        try:
            for pair in range(args.pairs):
                for algo in args.algos:
                    order = (False, True) if pair % 2 == 0 else (True, False)
                    arms = {}
                    for asynchronous in order:
                        recipe = arm_recipe(algo, asynchronous, args, server.url, seed=pair)
                        arms["async" if asynchronous else "sync"] = arm_process(recipe, args.warmup, args.cores)
                    for unit in ("generated", "trained"):
                        arms[f"ratio_{unit}"] = (arms["async"][f"seconds_per_10k_{unit}"]
                                                 / arms["sync"][f"seconds_per_10k_{unit}"])
                    arms["async_first"] = order[0]
                    results[algo].append(arms)
                    print(algo, pair, json.dumps(arms), flush=True)
        finally:
            server.stop()
    payload = {
        "what": "seconds per 10k generated completion tokens, async (AsyncGRPOTrainer) / sync (GRPOTrainer, "
                "vLLM server mode), same server and cores",
        "command": " ".join(["python", "benchmarks/async_wallclock.py", *sys.argv[1:]]),
        "settings": {key: value for key, value in vars(args).items() if key not in ("arm", "output")},
        "code_version": code_version(),
        "machine": {"cpus": os.cpu_count(), "cores_used": args.cores, "load_average_after": os.getloadavg()},
        "versions": package_versions(),
        "results": {algo: summary(pairs) for algo, pairs in results.items()},
    }
    write_json(Path(args.output), payload)
    print(json.dumps({algo: {key: value for key, value in result.items() if key != "pairs"}
                      for algo, result in payload["results"].items()}))


if __name__ == "__main__":
    main()
