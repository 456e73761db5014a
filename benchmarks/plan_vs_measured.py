"""`poise plan` against the measured peak of a POISE training step at Qwen3's real vocabulary and width.

Each case is the real-shape world (`poise toy build --world qwen3-shape`: a random-init Qwen3 at a size's
vocabulary, width and heads, with fewer decoder blocks) trained for one POISE step (`poise train` with
step_cost's POISE recipe, 2 rollouts per prompt, transformers generation) in its own process, under PyTorch's
profiler recording every CPU tensor allocation and free from before the model loads (step_memory's count of
live tensor bytes: the allocator's view, not RSS). The step splits in two windows: generation (TRL's
generate with POISE's capture around it) and the rest (loss forward, backward, AdamW). The plan
(`build_plan(device="cpu")`: one training micro-batch, the measured prompt width) covers the second; its
total is put next to that window's peak. For the generation window: its peak over the live bytes when it
opens, the KV cache it must hold, and the tensors POISE's capture keeps (ring, held ring, prompt vectors,
entropies) with the bound on the next-token logits waiting for their entropies.

    python benchmarks/plan_vs_measured.py [--cases 0.6b:2:16:256 1.7b:1:4:256 0.6b:1:2:4096]
        [--output benchmarks/results/plan_vs_measured.json]

A case is SIZE:LAYERS:ROWS:COMPLETION_TOKENS. The random-init policy never samples its EOS, so every
completion runs to the full length.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import sys
import tempfile
import time
from pathlib import Path

from step_cost import new_artefact, recipe_for, write_artefact
from step_memory import StepWindow

from poise_trl.core.provenance import write_json
from poise_trl.probe.capture import PENDING_LOGITS_ELEMENTS, GenerationCapture
from poise_trl.run.plan import ModelShape, Sharding, build_plan, load_model_config, plan_inputs
from poise_trl.run.recipe import parse_recipe
from poise_trl.run.toy import real_shape_config

DEFAULT_CASES = ("0.6b:2:16:256", "1.7b:1:4:256", "0.6b:1:2:4096")
TOLERANCE = 0.15  # the goal: the plan within +-15% of the peak it covers


class Windows:
    """Wall-clock (ns, the profiler's clock) windows of generate calls, the batch shapes the loss saw, and
    the sizes of what POISE's capture held when its features were read."""

    def __init__(self):
        from trl import GRPOTrainer

        from poise_trl.algorithms.poise import POISETrainer

        self.generation: list[tuple[int, int]] = []
        self.batch_shapes: list[dict] = []
        self.capture: dict = {}
        generate, loss, features = (POISETrainer._generate_single_turn, GRPOTrainer.compute_loss,
                                    GenerationCapture.features)

        def timed_generate(trainer, *args, **kwargs):
            start = time.time_ns()
            try:
                return generate(trainer, *args, **kwargs)
            finally:
                self.generation.append((start, time.time_ns()))

        def seen_loss(trainer, model, inputs, *args, **kwargs):
            self.batch_shapes.append({"prompt": list(inputs["prompt_ids"].shape),
                                      "completion": list(inputs["completion_ids"].shape)})
            return loss(trainer, model, inputs, *args, **kwargs)

        def sized_features(capture, *args, **kwargs):
            self.capture = capture_bytes(capture)
            return features(capture, *args, **kwargs)

        POISETrainer._generate_single_turn = timed_generate
        GRPOTrainer.compute_loss = seen_loss
        GenerationCapture.features = sized_features


def memory_events(prof) -> list[tuple[int, int]]:
    """(time in ns, +bytes allocated or -bytes freed) of every CPU tensor event the profiler recorded."""
    events = prof.profiler.kineto_results.events()
    return [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]


def window_peaks(memory_events: list[tuple[int, int]], step: tuple[int, int],
                 generation: list[tuple[int, int]]) -> dict:
    """From (time, +-bytes) allocation and free events: the live tensor bytes (allocations minus frees since
    profiling began) at their peak inside the generation windows and in the rest of the step, and when the
    first generation began."""
    live = generation_peak = training_peak = 0
    at_generation_start = None
    for when, delta in sorted(memory_events):
        if at_generation_start is None and generation and when >= generation[0][0]:
            at_generation_start = live
        live += delta
        if step[0] <= when <= step[1]:
            if any(start <= when <= end for start, end in generation):
                generation_peak = max(generation_peak, live)
            else:
                training_peak = max(training_peak, live)
    return {"training_peak_bytes": training_peak, "generation_peak_bytes": generation_peak,
            "live_bytes_at_generation_start": at_generation_start}


def measure_case(case: str, workdir: str, results) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from poise_trl.run.toy import build_real_shape_world
    from poise_trl.run.train import train_from_recipe

    size, layers, rows, completion = case.split(":")
    folder = Path(workdir) / case.replace(":", "-")
    log = open(Path(workdir) / f"{folder.name}.log", "w")
    sys.stdout = sys.stderr = log
    card = build_real_shape_world(folder / "model", size=size, layers=int(layers), seed=0)
    shape = {"model": str(folder / "model"), "per_device_train_batch_size": int(rows),
             "max_completion_length": int(completion)}
    recipe = recipe_for("poise.yaml", {}, 1, 0, shape)
    windows, step = Windows(), StepWindow()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_from_recipe(recipe, str(folder / "run"), show_progress=False, overwrite=True, callbacks=[step])
    measured = window_peaks(memory_events(prof), (step.first_step_ns, step.train_end_ns), windows.generation)
    prompt_width = windows.batch_shapes[0]["prompt"][1]
    config = load_model_config(shape["model"])
    kv_cache = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
                * int(rows) * (prompt_width + int(completion)))
    results.put({
        "case": case, "size": size, "layers": int(layers), "rows": int(rows),
        "completion_tokens": int(completion), "parameters": card["parameters"],
        "hidden_size": card["hidden_size"], "vocab_size": card["vocab_size"],
        "batch_shapes": windows.batch_shapes[:1], "torch_threads": torch.get_num_threads(), **measured,
        "generation_growth_bytes": (measured["generation_peak_bytes"]
                                    - measured["live_bytes_at_generation_start"]),
        "kv_cache_bytes": kv_cache, "capture_bytes": windows.capture,
        "wall_seconds": round(time.perf_counter() - started, 1),
    })


def add_plan(result: dict) -> dict:
    """`poise plan`'s CPU estimate for the case's recipe, model geometry and measured prompt width, beside the
    training peak. The case trains one step, in which AdamW allocates its state only at the optimizer step,
    after the backward pass has freed its activations: the plan's figure for that step is the larger of the
    plan without its optimizer-state item (the backward) and weights, gradients and optimizer state (the
    optimizer step). The whole plan is what later steps hold."""
    recipe = recipe_for("poise.yaml", {}, 1, 0, {"per_device_train_batch_size": result["rows"],
                                                 "max_completion_length": result["completion_tokens"]})
    inputs = plan_inputs(parse_recipe(recipe), prompt_length=result["batch_shapes"][0]["prompt"][1])
    shape = ModelShape.from_config(real_shape_config(result["size"], result["layers"]).to_dict())
    plan = build_plan(inputs, shape, gpus=1, gpu_bytes=2**40, sharding=Sharding("single"), device="cpu")
    items = {item.name: item.bytes for item in plan.items}
    backward = plan.total - items["optimizer state"]
    optimizer_step = items["weights"] + items["gradients"] + items["optimizer state"]
    first_step = max(backward, optimizer_step)
    result.update(plan_items_bytes=items, plan_bytes=plan.total, plan_without_optimizer_state_bytes=backward,
                  plan_at_optimizer_step_bytes=optimizer_step, plan_first_step_bytes=first_step,
                  plan_first_step_peak_at="optimizer step" if optimizer_step > backward else "backward",
                  plan_over_training_peak=round(first_step / result["training_peak_bytes"], 3))
    result["within_tolerance"] = abs(result["plan_over_training_peak"] - 1) <= TOLERANCE
    return result


def capture_bytes(capture: GenerationCapture) -> dict:
    """The tensors a finished GenerationCapture holds, and the bound on the logits waiting for entropies."""
    held = {"ring": capture._ring, "held_ring": capture._held, "prompt_vectors": capture._prompt,
            "entropies": capture._entropy}
    sizes = {name: t.numel() * t.element_size() for name, t in held.items()}
    rows, vocabulary = capture._ring.shape[0], capture.lm.config.vocab_size
    # logits wait until PENDING_LOGITS_ELEMENTS, or one step's where that is more (a real vocabulary)
    sizes["pending_logits_bound"] = 4 * max(PENDING_LOGITS_ELEMENTS, rows * vocabulary)
    sizes["completion_tokens"] = capture._entropy.shape[1]
    return sizes


def measure_capture(spec: str) -> dict:
    """SIZE:LAYERS:ROWS:TOKENS: `generate` of that many tokens under POISE's capture, on the profiler: the
    live bytes when generate starts, their peak inside it, the KV cache it must hold and the capture's
    tensors."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen3ForCausalLM

    from poise_trl.run.toy import qwen3_tokenizer

    size, layers, rows, tokens = spec.split(":")
    rows, tokens = int(rows), int(tokens)
    tokenizer = qwen3_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 2}?"}],
                                             tokenize=False, add_generation_prompt=True) for i in range(rows)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(real_shape_config(size, int(layers))).eval()
        started = time.time_ns()
        with torch.no_grad(), GenerationCapture(model, 0.55, [tokenizer.eos_token_id],
                                                tokenizer.convert_tokens_to_ids("</think>")) as capture:
            out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                                 top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
            capture.finish(out[:, batch["input_ids"].shape[1]:].tolist(), tokenizer.pad_token_id)
        ended = time.time_ns()
    peaks = window_peaks(memory_events(prof), (started, ended), [(started, ended)])
    config = model.config
    prompt_width = batch["input_ids"].shape[1]
    return {"spec": spec, "rows": rows, "completion_tokens": tokens, "prompt_tokens": prompt_width,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "layers": config.num_hidden_layers,
            "live_bytes_at_generate_start": peaks["live_bytes_at_generation_start"],
            "generate_peak_bytes": peaks["generation_peak_bytes"],
            "generate_growth_bytes": peaks["generation_peak_bytes"] - peaks["live_bytes_at_generation_start"],
            "kv_cache_bytes": 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
            * rows * (prompt_width + tokens),
            "capture_bytes": capture_bytes(capture), "wall_seconds": round((ended - started) / 1e9, 1)}


def run_case(case: str, workdir: Path) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=measure_case, args=(case, str(workdir), results))
    process.start()
    while process.is_alive() or not results.empty():
        try:
            return results.get(timeout=5)
        except queue.Empty:
            continue
    log = workdir / f"{case.replace(':', '-')}.log"
    tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
    sys.exit(f"error: case {case} failed ({' '.join(tail)}); log: {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES),
                        help="SIZE:LAYERS:ROWS:COMPLETION_TOKENS")
    parser.add_argument("--captures", nargs="*", default=[], help="SIZE:LAYERS:ROWS:TOKENS: generate alone "
                        "under POISE's capture (long completions without a training step)")
    parser.add_argument("--replan", default=None, help="an artefact of this script: recompute its plan "
                        "columns with today's `poise plan`, keeping what was measured")
    parser.add_argument("--output", default="benchmarks/results/plan_vs_measured.json")
    cli = parser.parse_args()
    if cli.replan:
        payload = json.loads(Path(cli.replan).read_text())
        _, head = new_artefact("plan_vs_measured.py", ["cpu"], ["cpu"])
        payload["replanned"] = {"command": head["command"], "code_version": head["code_version"]}
        payload["cases"] = [add_plan(case) for case in payload["cases"]]
        write_json(Path(cli.output), payload)
        print(f"wrote {cli.output}")
        return
    _, payload = new_artefact("plan_vs_measured.py", ["cpu"], ["cpu"])
    payload.update(measure="peak live tensor bytes from PyTorch's profiler (allocations minus frees), "
                   "not RSS",
                   tolerance=TOLERANCE, cases=[], captures=[])
    for spec in cli.captures:
        print(f"{spec}: generate under POISE's capture, on the profiler ...", flush=True)
        payload["captures"].append(measure_capture(spec))
        print(f"{spec}: {payload['captures'][-1]}", flush=True)
        write_artefact(payload, cli.output)
    with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as workdir:
        for case in cli.cases:
            print(f"{case}: one POISE step under the profiler ...", flush=True)
            result = add_plan(run_case(case, Path(workdir)))
            payload["cases"].append(result)
            plan = result["plan_first_step_bytes"]
            print(f"{case}: plan {plan / 2**20:.0f} MiB vs training peak "
                  f"{result['training_peak_bytes'] / 2**20:.0f} MiB (x{result['plan_over_training_peak']}); "
                  f"generation grew {result['generation_growth_bytes'] / 2**20:.0f} MiB (KV cache "
                  f"{result['kv_cache_bytes'] / 2**20:.0f} MiB), capture {result['capture_bytes']}",
                  flush=True)
            write_artefact(payload, cli.output)  # after each case: a long case stopped keeps the ones before


if __name__ == "__main__":
    main()
