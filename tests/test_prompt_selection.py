"""Probe-guided prompt selection and the prompt-only probe (POISETrainer docstring): the selection
rule with its random floor, the prompt-only probe on the same buffer, the prefill's prompt vectors
equal to the rollout pass's, the per-prompt estimator unchanged, and the prefill charged to the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poise_trl.algorithms.poise import select_prompts
from poise_trl.core import estimators
from poise_trl.probe.capture import extract_features, extract_prompt_vectors
from poise_trl.probe.estimator import ProbeEstimator
from poise_trl.probe.features import RolloutFeatures

ROOT = Path(__file__).resolve().parents[1]


def test_select_prompts_takes_floor_then_most_informative():
    predicted = torch.tensor([0.0, 1.0, 0.5, 0.9, 0.4, 0.05, float("nan"), 0.6])
    chosen, from_floor = select_prompts(predicted, k=4, random_count=0, generator=torch.Generator().manual_seed(0))
    # p(1-p): 0, 0, .25, .09, .24, .0475, nan -> .25, .24; ties keep candidate order.
    assert chosen == [2, 6, 4, 7] and from_floor == [False] * 4
    chosen, from_floor = select_prompts(predicted, k=4, random_count=2, generator=torch.Generator().manual_seed(1))
    floor = torch.randperm(8, generator=torch.Generator().manual_seed(1))[:2].tolist()
    assert chosen[:2] == floor and from_floor == [True, True, False, False]
    rest = [i for i in [2, 6, 4, 7, 3, 5, 0, 1] if i not in floor][:2]
    assert chosen[2:] == rest and len(set(chosen)) == 4


def test_random_floor_reaches_every_prompt():
    # Prompts the probe rates certain (p = 0 or 1) are never ranked, but the floor still draws them.
    predicted = torch.tensor([0.0] * 6 + [0.5] * 2)
    seen = set()
    for seed in range(50):
        chosen, _ = select_prompts(predicted, k=3, random_count=1, generator=torch.Generator().manual_seed(seed))
        seen |= set(chosen)
    assert seen == set(range(8))
    with pytest.raises(ValueError):
        select_prompts(predicted, k=9, random_count=1, generator=torch.Generator())


def test_prompt_only_probe_fits_on_the_buffer_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    n, d = 256, 12
    prompt = torch.randn(n // 2, d, generator=g).repeat_interleave(2, dim=0)  # pairs share their prompt
    p = torch.sigmoid(3 * prompt[:, 0])
    features = RolloutFeatures(prompt, torch.randn(n, d, generator=g), torch.rand(n, 3, generator=g))
    rewards = torch.bernoulli(p, generator=g)
    est = ProbeEstimator(prompt_components=d, response_components=4, ridge_alpha=1.0, capacity_rows=512,
                         bootstrap_steps=1, prompt_probe=True)
    est.update(features, rewards, group_size=2)
    predicted, available = est.predict_prompts(prompt)
    assert available.all()
    assert torch.corrcoef(torch.stack([predicted, p]))[0, 1] > 0.5
    # It reads the prompt alone: other responses and entropies do not move it.
    assert torch.equal(est.predict_prompts(prompt)[0], predicted)
    est.save(tmp_path)
    loaded = ProbeEstimator.load(tmp_path)
    assert torch.equal(loaded.predict_prompts(prompt)[0], predicted)
    assert torch.equal(loaded.predict(features)[0], est.predict(features)[0])
    with pytest.raises(RuntimeError, match="prompt_probe=True"):
        ProbeEstimator(bootstrap_steps=1).predict_prompts(prompt)
    prompt_only = ProbeEstimator(prompt_components=d, ridge_alpha=1.0, bootstrap_steps=1, inputs="prompt")
    prompt_only.update(features, rewards, group_size=2)
    shuffled = RolloutFeatures(prompt, features.response.flip(0), features.entropy.flip(0))
    assert torch.equal(prompt_only.predict(shuffled)[0], prompt_only.predict(features)[0])


def test_prefill_prompt_vectors_match_the_rollout_pass():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ROOT / "poise_trl" / "data" / "tiny-qwen3")
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, 100, (3, 7), generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 1, 1, 1]])
    completion_ids = torch.randint(5, 100, (3, 5), generator=g)
    completion_mask = torch.ones(3, 5, dtype=torch.long)
    full = extract_features(model, prompt_ids, prompt_mask, completion_ids, completion_mask, -1, [2], batch_size=3,
                            n_pool=4)[2]
    prefill = extract_prompt_vectors(model, prompt_ids, prompt_mask, 2, batch_size=2, n_pool=4)
    torch.testing.assert_close(prefill, full.prompt, rtol=1e-5, atol=1e-5)


def test_selection_leaves_the_per_prompt_estimator_unchanged():
    # Selection only decides which prompts are rolled out; given the pairs, A_1 = r_1 - g(z_2).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    predictions = torch.tensor([0.3, 0.6, 0.8, 0.9])
    advantages, baselines = estimators.cross_rollout_advantages(rewards, predictions, 2)
    assert torch.allclose(advantages, torch.tensor([1 - 0.6, 0 - 0.3, 1 - 0.9, 1 - 0.8]))
    assert torch.allclose(baselines, torch.tensor([0.6, 0.3, 0.9, 0.8]))


@pytest.mark.slow
def test_selection_run_counts_prefill_in_budget_and_resumes(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    settings = ["max_steps=4", "probe_bootstrap_steps=2", "eval_every=0", "logging_steps=1", "save_steps=3",
                "per_device_train_batch_size=16", "max_completion_length=48", "eval_max_new_tokens=48",
                "eval_limit=8", "eval_num_samples=1"]
    command = [sys.executable, "-m", "poise_trl.cli.main", "train", str(ROOT / "recipes/toy/poise_select.yaml"),
               "--no-progress", "-o", str(tmp_path / "run"), *settings]
    subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    log = [e for e in summary["train_log"] if "selection/candidates_scored" in e]
    assert [e["step"] for e in log] == [3, 4]  # probe active from step 3
    assert log[-1]["selection/candidates_scored"] == 2 * 16 and log[-1]["selection/prompts_skipped"] == 16
    lengths = [e["completions/mean_length"] * 16 for e in summary["train_log"] if "completions/mean_length" in e]
    prefill = log[-1]["selection/prefill_tokens"]
    assert summary["generated_tokens"] == pytest.approx(sum(lengths) + prefill, abs=1)
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "poise_selection.json").read_text())
    assert state["batches_drawn"] == 1 and state["counts"]["candidates_scored"] == 16
