"""Peak tensor memory of training, POISE against GRPO in each mode, counted allocation by allocation.

A process's resident set cannot resolve the difference (two identical GRPO processes differ by tens of
MiB, the probe buffer is about one), so each arm runs in its own process with PyTorch's profiler
recording every CPU tensor allocation and free from before the model loads to the end of training.
The running sum of those events is the bytes of tensors alive at each moment; its maximum over the
training steps is the arm's peak (20 steps by default: the toy probe's buffer of 1024 rows is full after
16 steps of 64 rollouts). Both arms run the step_cost recipes (toy-arith, 64 completions per
step, a learning rate that leaves the policy as it is, so both sample the same completions:
`same_rollouts`). For each mode: each arm's peak and its live bytes as the first step begins, POISE's
probe buffer, and whether POISE's peak is at most GRPO's plus that buffer.

    python benchmarks/step_memory.py [--steps 20] [--modes transformers trl_pass vllm_colocate]
        [--model DIR --prompts 8 --completion-length 256] [--output benchmarks/results/step_memory.json]

`--model`, `--prompts` and `--completion-length` set every arm's policy and batch as in step_cost (the
real-shape world); the artefact records the model's geometry under `shape`.

What the profiler does not see: memory outside PyTorch's CPU allocator (Python objects, vLLM's own
buffers not held in tensors). The colocate mode needs vLLM's CPU build; with `--modes` left out it is
skipped, with a note, where vLLM does not import.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import sys
import tempfile
import time
from pathlib import Path

from step_cost import (
    PAIRS,
    last_logged,
    model_geometry,
    new_artefact,
    probe_buffer_bytes,
    recipe_for,
    shape_overrides,
    step_phases,
    write_artefact,
)
from transformers import TrainerCallback

MODES = ("transformers", "trl_pass", "vllm_colocate")  # step_cost's POISE / GRPO pairs


class StepWindow(TrainerCallback):
    """When the training steps begin and end, on the profiler's clock (wall-clock nanoseconds)."""

    def __init__(self):
        self.first_step_ns = self.train_end_ns = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.first_step_ns = self.first_step_ns or time.time_ns()

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end_ns = time.time_ns()


def live_bytes_peaks(events, window: tuple[int, int]) -> dict:
    """From the profiler's allocation (+bytes) and free (-bytes) events: the live bytes just before the
    window opens and their maximum inside it. Frees of blocks allocated before profiling began are not
    reported by PyTorch, so the sum counts exactly the blocks allocated while it ran."""
    start, end = window
    live = before = peak = 0
    for when, delta in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += delta
        if when < start:
            before = live
        elif when <= end:
            peak = max(peak, live)
    return {"live_bytes_at_first_step": before, "peak_bytes_during_training": max(peak, before)}


def memory_arm(recipe: dict, output_dir: str, results) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from poise_trl.run.train import train_from_recipe

    log = open(Path(output_dir).with_suffix(".log"), "w")
    sys.stdout = sys.stderr = log
    phases = step_phases("poise")  # to find the probe, if there is one
    window = StepWindow()
    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        summary = train_from_recipe(recipe, output_dir, show_progress=False, overwrite=True, callbacks=[window])
    result = live_bytes_peaks(prof.profiler.kineto_results.events(), (window.first_step_ns, window.train_end_ns))
    result["num_tokens"] = last_logged(summary["train_log"], "num_tokens")
    result["steps"] = summary["steps"]
    if "probe_refit" in phases.last_self:
        result["probe_buffer_bytes"] = probe_buffer_bytes(phases.last_self["probe_refit"])
    results.put(result)


def measure_arm(recipe: dict, output_dir: Path) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=memory_arm, args=(recipe, str(output_dir), results))
    process.start()
    while process.is_alive() or not results.empty():
        try:
            return results.get(timeout=5)
        except queue.Empty:  # the arm is still training
            continue
    tail = output_dir.with_suffix(".log").read_text().strip().splitlines()[-1:]
    sys.exit(f"error: {recipe['algo']} arm failed ({' '.join(tail)}); log: {output_dir.with_suffix('.log')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps per arm")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="every arm's policy (default: the recipes' tiny model)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step, 2 rollouts each (32)")
    parser.add_argument("--completion-length", type=int, default=None, help="max_completion_length (96)")
    parser.add_argument("--output", default="benchmarks/results/step_memory.json")
    cli = parser.parse_args()
    modes, payload = new_artefact("step_memory.py", cli.modes, list(MODES))
    shape = shape_overrides(cli.model, cli.prompts, cli.completion_length)
    if shape:
        payload["shape"] = {**shape, "model_geometry": model_geometry(shape.get("model", "data/tiny-qwen3"))}
    payload["modes"] = {}
    with tempfile.TemporaryDirectory(prefix="step_memory_") as workdir:
        for mode in modes:
            arms = {}
            for (_, recipe_file, overrides) in PAIRS[mode]:
                recipe = recipe_for(recipe_file, overrides, cli.steps, cli.seed, shape)
                print(f"{mode}: {recipe['algo']}, {cli.steps} steps under the profiler ...", flush=True)
                arms[recipe["algo"]] = measure_arm(recipe, Path(workdir) / f"{mode}-{recipe['algo']}")
            poise, grpo = arms["poise"], arms["grpo"]
            excess = poise["peak_bytes_during_training"] - grpo["peak_bytes_during_training"]
            payload["modes"][mode] = {
                "overrides": PAIRS[mode][0][2], "poise": poise, "grpo": grpo,
                "poise_peak_minus_grpo_peak_bytes": excess,
                "within_grpo_plus_probe_buffer": excess <= poise["probe_buffer_bytes"],
                "same_rollouts": poise["num_tokens"] == grpo["num_tokens"],
            }
            print(f"{mode}: peak {poise['peak_bytes_during_training'] / 2**20:.2f} MiB (POISE) vs "
                  f"{grpo['peak_bytes_during_training'] / 2**20:.2f} MiB (GRPO), "
                  f"difference {excess / 2**20:+.3f} MiB, "
                  f"probe buffer {poise['probe_buffer_bytes'] / 2**20:.3f} MiB", flush=True)
    write_artefact(payload, cli.output)


if __name__ == "__main__":
    main()
