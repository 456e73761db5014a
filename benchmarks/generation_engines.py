"""vLLM vs transformers generation, and POISE vs GRPO (2 rollouts) in vLLM colocate mode.

On the bundled tiny model, in one run:
- the bench workload (`--prompts` toy-arith problems x `--samples` samples, T=1.0, 96 new tokens)
  through each engine: samples/s and completion tokens/s (engine start-up timed separately), and
  the mean accuracy each engine's samples reach (the two should agree within sampling error);
- `poise train` of POISE and of GRPO with num_generations=2 on the same batch geometry in vLLM
  colocate mode: mean step time (first step dropped) and policy forward passes per step.

    python benchmarks/generation_engines.py [--prompts 200] [--samples 8] [--steps 6]
        [--output benchmarks/results/generation_engines.json]

Needs vLLM (docs/install.md: GPU or CPU build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "poise_trl" / "data" / "tiny-qwen3"


def bench_workload(engine: str, prompts: list, answers: list, samples: int, max_new_tokens: int) -> dict:
    from poise_trl.engines.generation import sample_transformers, sample_vllm, vllm_engine
    from poise_trl.tasks.math_grader import is_correct

    kwargs = dict(num_samples=samples, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    started = time.perf_counter()
    if engine == "vllm":
        vllm_engine(str(MODEL))
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        out = sample_vllm(str(MODEL), prompts, **kwargs)
    else:
        from transformers import AutoModelForCausalLM

        from poise_trl.core.loading import load_tokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(MODEL), load_tokenizer(str(MODEL))
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        out = sample_transformers(model, tokenizer, prompts, batch_size=256, **kwargs)
    seconds = time.perf_counter() - started
    tokens = sum(s.num_tokens for s in out)
    correct = [float(is_correct(s.text, answers[s.prompt_index])) for s in out]
    return {
        "engine": engine, "load_seconds": round(load_seconds, 2), "generate_seconds": round(seconds, 2),
        "samples": len(out), "completion_tokens": tokens,
        "samples_per_second": round(len(out) / seconds, 1), "tokens_per_second": round(tokens / seconds, 1),
        "accuracy": statistics.mean(correct),
        "accuracy_stderr": statistics.stdev(correct) / len(correct) ** 0.5,
    }


def colocate_step(recipe: str, steps: int, out: Path, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "poise_trl.cli.main", "train", f"recipes/toy/{recipe}.yaml", "use_vllm=true",
           "vllm_mode=colocate", f"max_steps={steps}", "logging_steps=1", "save_strategy='no'", "eval_limit=8",
           "eval_num_samples=1", "eval_every=0", *overrides, "--output-dir", str(out), "--no-progress"]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    step_times = [e["step_time"] for e in summary["train_log"] if "step_time" in e][1:]
    return {
        "recipe": recipe, "overrides": list(overrides), "steps": summary["steps"],
        "mean_step_seconds": round(statistics.mean(step_times), 3),
        "policy_forward_passes_per_step": summary["generation"]["policy_forward_passes_per_step"],
        "generation": summary["generation"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=6, help="colocate training steps per algorithm")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks/results/generation_engines.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from poise_trl.core.provenance import package_versions, write_json
    from poise_trl.engines.generation import close_vllm_engines, vllm_import_error
    from poise_trl.tasks import load_prompt_dataset

    if vllm_import_error():
        sys.exit(f"error: {vllm_import_error()}; this benchmark compares it with transformers")
    data = load_prompt_dataset("toy-arith", split="test", limit=args.prompts, seed=0)
    prompts, answers = data["prompt"], data["answer"]
    engines = {e: bench_workload(e, prompts, answers, args.samples, args.max_new_tokens)
               for e in ("vllm", "transformers")}
    close_vllm_engines()
    gap = abs(engines["vllm"]["accuracy"] - engines["transformers"]["accuracy"])
    gap_se = (engines["vllm"]["accuracy_stderr"] ** 2 + engines["transformers"]["accuracy_stderr"] ** 2) ** 0.5

    with tempfile.TemporaryDirectory() as tmp:
        # POISE's geometry: 32 prompts x 2 rollouts; GRPO with the same rollouts and prompts.
        poise = colocate_step("poise", args.steps, Path(tmp) / "poise", "probe_bootstrap_steps=2")
        grpo = colocate_step("grpo", args.steps, Path(tmp) / "grpo", "num_generations=2")

    result = {
        "workload": {"prompts": len(prompts), "samples_per_prompt": args.samples,
                     "max_new_tokens": args.max_new_tokens, "model": "data/tiny-qwen3"},
        "engines": engines,
        "vllm_speedup_samples_per_second": round(
            engines["vllm"]["samples_per_second"] / engines["transformers"]["samples_per_second"], 2),
        "accuracy_gap": round(gap, 4), "accuracy_gap_in_standard_errors": round(gap / gap_se, 2),
        "colocate": {"poise": poise, "grpo": grpo,
                     "step_time_ratio_poise_over_grpo":
                         round(poise["mean_step_seconds"] / grpo["mean_step_seconds"], 3),
                     "forward_passes_equal":
                         poise["policy_forward_passes_per_step"] == grpo["policy_forward_passes_per_step"]},
        "torch_threads": os.environ["OMP_NUM_THREADS"],
        "versions": package_versions(),
    }
    write_json(args.output, result)
    for name, e in engines.items():
        print(f"{name:>12}: {e['samples_per_second']:.1f} samples/s, {e['tokens_per_second']:.0f} tokens/s, "
              f"start {e['load_seconds']:.1f} s, accuracy {e['accuracy']:.3f} ± {e['accuracy_stderr']:.3f}")
    print(f"colocate step: POISE {poise['mean_step_seconds']:.2f} s, GRPO-2 {grpo['mean_step_seconds']:.2f} s "
          f"(ratio {result['colocate']['step_time_ratio_poise_over_grpo']:.2f}); policy forward passes per step "
          f"{poise['policy_forward_passes_per_step']} vs {grpo['policy_forward_passes_per_step']}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
