"""The fast (warm-started randomized) probe fit against the exact one, at widths where it runs.

Tolerance: the fast fit is only useful if swapping it in changes the baseline less than the
exact probe itself changes from one step to the next (one batch in, one out). So on a sliding
buffer the mean |fast - exact| prediction gap must stay under half of the exact probe's mean
step-to-step change, and its error against held-out targets within 1% of the exact fit's.
"""

from __future__ import annotations

import random

import pytest
import torch

import poise_trl.probe.estimator as probe_module
from poise_trl.probe.estimator import LinearValueProbe, ProbeEstimator, _fit_pca, _fit_pca_fast
from poise_trl.probe.features import RolloutFeatures

pytestmark = pytest.mark.usefixtures("single_thread")

WIDTH = 640  # above EXACT_PCA_MAX_DIM, so "fast" takes the randomized path


def realistic(n: int, seed: int, d: int = WIDTH) -> tuple[RolloutFeatures, torch.Tensor]:
    """Hidden-state-like rows: 8 strong directions carrying the signal, a power-law noise spectrum
    in a random basis, and a large common offset (the mean LLM activations have)."""
    mix = torch.Generator().manual_seed(1)  # the same "model" for every seed
    strong = torch.randn(8, d, generator=mix) * torch.linspace(3, 0.5, 8)[:, None]
    basis = torch.linalg.qr(torch.randn(d, d, generator=mix)).Q
    decay = torch.arange(1, d + 1, dtype=torch.float32) ** -0.5
    offset = 5 * torch.randn(d, generator=mix)
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 8, generator=g)

    def noise():
        return 2 * (torch.randn(n, d, generator=g) * decay) @ basis.T

    prompt = latent @ strong + noise() + offset
    response = latent.flip(1) @ strong + noise()
    entropy = torch.rand(n, 3, generator=g)
    target = 0.5 + 0.1 * latent[:, 0] - 0.1 * latent[:, 1] + 0.05 * torch.randn(n, generator=g)
    return RolloutFeatures(prompt, response, entropy), target.clamp(0, 1)


def sliding_buffers(stream, window: int):
    for end in range(window, len(stream) + 1):
        part = stream[end - window : end]
        yield RolloutFeatures.cat([f for f, _ in part]), torch.cat([y for _, y in part])


def assert_fast_tracks_exact(stream, test, y_test, window):
    fast, previous, gaps, drifts = LinearValueProbe(), None, [], []
    for feats, y in sliding_buffers(stream, window):
        exact = LinearValueProbe(fit_method="exact").fit(feats, y).predict(test)
        fast_pred = fast.fit(feats, y).predict(test)
        gaps.append((fast_pred - exact).abs().mean())
        if previous is not None:
            drifts.append((exact - previous).abs().mean())
        previous = exact
        mae_fast, mae_exact = (fast_pred - y_test).abs().mean(), (exact - y_test).abs().mean()
        assert mae_fast <= 1.01 * mae_exact + 1e-4
    gap, drift = torch.stack(gaps).mean(), torch.stack(drifts).mean()
    assert gap < 0.5 * drift, (gap, drift)
    return gap, drift


def test_fast_fit_tracks_exact_on_a_sliding_buffer():
    stream = [realistic(128, seed=s) for s in range(9)]
    test, y_test = realistic(500, seed=99)
    assert_fast_tracks_exact(stream, test, y_test, window=6)


def test_fast_pca_recovers_the_strong_directions():
    x = realistic(1024, seed=0)[0].response.double()
    _, exact, exact_proj = _fit_pca(x, 8)
    _, fast, fast_proj = _fit_pca_fast(x.float(), 8)
    # same top-8 subspace: cosines of the principal angles all ~1
    cosines = torch.linalg.svdvals(exact @ fast.T)
    assert cosines.min() > 0.999
    # the sign convention makes the matching components agree, not just the subspaces
    assert (exact * fast).sum(1).min() > 0.99
    assert torch.allclose(fast_proj, (x - x.mean(0)) @ fast.T, atol=1e-3)
    assert exact_proj.shape == fast_proj.shape == (1024, 8)


def test_fast_pca_contract_on_degenerate_inputs():
    few = torch.randn(20, WIDTH)  # fewer rows than components: k' = rows, last one beyond the rank
    mean, comps, proj = _fit_pca_fast(few, 64)
    assert comps.shape == (20, WIDTH) and proj.shape == (20, 20)
    assert comps[:19].abs().sum(1).min() > 0 and not comps[19].any()
    same = torch.full((10, WIDTH), 0.3)
    assert not _fit_pca_fast(same, 4)[1].any()  # identical rows: no direction at all
    warm = _fit_pca_fast(few, 8, init=torch.zeros(8, WIDTH))[1]  # zero init rows fall back to random
    assert torch.isfinite(warm).all() and warm.abs().sum(1).min() > 0


def test_fast_fit_on_the_tiny_models_real_features(bundled_model_dir, monkeypatch):
    """Real hidden states (block 2 of the bundled model) of worked solutions with and without slips;
    the target is whether the solution is right. d=128 would be fit exactly, so the width threshold
    is lowered to exercise the randomized path on these features."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poise_trl.probe.capture import extract_features
    from poise_trl.tasks.toy_task import assistant_response, generate_problems

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir)
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir)
    rng = random.Random(0)
    prompts, completions, rewards = [], [], []
    for problem in generate_problems(480, seed=7):
        text = assistant_response(problem["a"], problem["b"], slip_rate=0.15, rng=rng)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem["question"]}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        rewards.append(float(text.endswith("{" + problem["answer"] + "}")))

    def pad(seqs, left):
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols], mask[i, cols] = torch.tensor(s), 1
        return ids, mask

    think_end = tokenizer.convert_tokens_to_ids("</think>")
    feats = extract_features(model, *pad(prompts, True), *pad(completions, False), think_end, 0.55, 96)
    feats = next(iter(feats.values()))
    y = torch.tensor(rewards)
    assert 0.5 < y.mean() < 0.95  # both outcomes present
    monkeypatch.setattr(probe_module, "EXACT_PCA_MAX_DIM", 0)
    stream = [(feats[i : i + 64], y[i : i + 64]) for i in range(0, 384, 64)]
    gap, drift = assert_fast_tracks_exact(stream, feats[384:], y[384:], window=4)
    assert gap < 0.01


def test_fast_fit_deterministic_for_inputs_and_state():
    (f1, y1), (f2, y2) = realistic(256, seed=0), realistic(256, seed=1)
    a, b = LinearValueProbe().fit(f1, y1), LinearValueProbe().fit(f1, y1)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    # warm start: same previous state + same buffer -> identical, on a separate object too
    c = LinearValueProbe()
    c.load_state_dict(a.state_dict())
    a.fit(f2, y2), c.fit(f2, y2)
    assert torch.equal(a.predict(f1), c.predict(f1))
    # and the warm start is used: a cold fit of the same buffer is close but not identical
    cold = LinearValueProbe().fit(f2, y2)
    assert not torch.equal(cold.state_dict()["response_components"], a.state_dict()["response_components"])
    assert (cold.predict(f1) - a.predict(f1)).abs().mean() < 0.01


@pytest.mark.parametrize("fit_method", ["fast", "exact"])
def test_prompt_only_probe_reusing_the_main_probes_prompt_pca_fits_identically(fit_method):
    main, own = LinearValueProbe(fit_method=fit_method), LinearValueProbe(fit_method=fit_method, inputs="prompt")
    reusing = LinearValueProbe(fit_method=fit_method, inputs="prompt")
    for seed in (0, 1):  # the second fit warm-starts from the first under "fast"
        features, targets = realistic(256, seed=seed)
        main.fit(features, targets)
        own.fit(features, targets)
        reusing.fit(features, targets, prompt_pca=main.fitted_prompt_pca)
        for name, tensor in own.state_dict().items():
            assert torch.equal(tensor, reusing.state_dict()[name]), name
    with pytest.raises(ValueError, match="fitted on 256 rows, not these 128"):
        reusing.fit(features[:128], targets[:128], prompt_pca=main.fitted_prompt_pca)


def test_estimator_resume_round_trip_with_fast_fit(tmp_path):
    est = ProbeEstimator(bootstrap_steps=2, capacity_rows=384)
    assert est.config["fit_method"] == "fast"
    data = [realistic(128, seed=s) for s in range(6)]
    for feats, y in data[:3]:
        est.update_from_targets(feats, y, group_size=2)
    est.save(tmp_path)
    loaded = ProbeEstimator.load(tmp_path)
    assert loaded.config == est.config
    for feats, y in data[3:]:  # warm-started refits continue identically after the resume
        assert torch.equal(est.predict(feats)[0], loaded.predict(feats)[0])
        est.update_from_targets(feats, y, group_size=2)
        loaded.update_from_targets(feats, y, group_size=2)
    assert torch.equal(est.predict(data[0][0])[0], loaded.predict(data[0][0])[0])


def test_checkpoints_from_before_fit_method_resume_exactly(tmp_path):
    import json

    est = ProbeEstimator(bootstrap_steps=1, fit_method="exact")
    est.update_from_targets(*realistic(8, seed=0, d=16), group_size=2)
    est.save(tmp_path)
    meta = json.loads((tmp_path / "poise_probe.json").read_text())
    del meta["config"]["fit_method"]
    (tmp_path / "poise_probe.json").write_text(json.dumps(meta))
    assert ProbeEstimator.load(tmp_path).config["fit_method"] == "exact"
    with pytest.raises(ValueError, match="fit_method must be one of"):
        LinearValueProbe(fit_method="svd")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fit_on_cuda_matches_cpu():
    stream = [realistic(128, seed=s) for s in range(4)]
    test, _ = realistic(200, seed=99)
    on_gpu, on_cpu = LinearValueProbe(device="cuda"), LinearValueProbe()
    for feats, y in sliding_buffers(stream, 3):
        on_gpu.fit(feats, y), on_cpu.fit(feats, y)
    assert all(t.device.type == "cpu" for t in on_gpu.state_dict().values())
    assert torch.allclose(on_gpu.predict(test), on_cpu.predict(test), atol=1e-4)
    exact_gpu = LinearValueProbe(fit_method="exact", device="cuda").fit(feats, y)
    exact_cpu = LinearValueProbe(fit_method="exact").fit(feats, y)
    assert torch.allclose(exact_gpu.predict(test), exact_cpu.predict(test), atol=1e-4)


def test_config_rejects_an_unknown_fit(tmp_path):
    from poise_trl.algorithms.poise import POISEConfig

    assert POISEConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).probe_fit == "fast"
    with pytest.raises(ValueError, match="probe_fit must be 'fast' or 'exact'"):
        POISEConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, probe_fit="svd")
