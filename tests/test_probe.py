"""Tests for poise_trl.probe.estimator: the linear probe, the group buffer, the online estimator, metrics."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch

from poise_trl.probe.estimator import GroupBuffer, LinearValueProbe, ProbeEstimator, probe_metrics
from poise_trl.probe.features import RolloutFeatures

pytestmark = pytest.mark.usefixtures("single_thread")


def synthetic(
    n: int, d: int = 48, seed: int = 0, noise: float = 0.02
) -> tuple[RolloutFeatures, torch.Tensor]:
    """Low-rank hidden states (rank 4) whose latent factors linearly determine the target."""
    g = torch.Generator().manual_seed(seed)
    mix_g = torch.Generator().manual_seed(123)  # the same "model" for every seed
    w_prompt, w_response = torch.randn(4, d, generator=mix_g), torch.randn(4, d, generator=mix_g)
    latent = torch.randn(n, 4, generator=g)
    prompt = latent @ w_prompt + 0.01 * torch.randn(n, d, generator=g)
    response = latent.flip(1) @ w_response + 0.01 * torch.randn(n, d, generator=g)
    entropy = torch.rand(n, 3, generator=g)
    target = 0.5 + 0.12 * latent[:, 0] - 0.08 * latent[:, 1] + 0.1 * (entropy[:, 0] - 0.5)
    target = (target + noise * torch.randn(n, generator=g)).clamp(0, 1)
    return RolloutFeatures(prompt, response, entropy), target


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


# ---------------------------------------------------------------------------------------------
# LinearValueProbe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_pca", [True, False])
def test_probe_fits_linear_signal(use_pca):
    train, y_train = synthetic(400, seed=0)
    test, y_test = synthetic(200, seed=1)
    probe = LinearValueProbe(use_pca=use_pca).fit(train, y_train)
    pred = probe.predict(test)
    assert pred.shape == (200,) and pred.dtype == torch.float32
    assert pearson(pred, y_test) > 0.9
    expected_dims = 32 + 48 + 3 if use_pca else 2 * 48 + 3  # response PCA capped by d = 48
    assert len(probe.feature_names) == expected_dims
    assert probe.feature_names[-3:] == ["entropy_completion", "entropy_reasoning", "entropy_answer"]


def test_predictions_clipped_to_unit_interval():
    train, y = synthetic(300)
    probe = LinearValueProbe().fit(train, y)
    far = RolloutFeatures(train.prompt * 50, train.response * 50, train.entropy)
    pred = probe.predict(far)
    assert pred.min() == 0.0 and pred.max() == 1.0
    assert ((pred == 0) | (pred == 1)).float().mean() > 0.5


def test_pca_dims_capped_by_rows_and_width():
    feats, y = synthetic(6, d=48)
    state = LinearValueProbe().fit(feats, y).state_dict()
    assert state["prompt_components"].shape == (6, 48)
    assert state["response_components"].shape == (6, 48)
    # the 6th component of 6 centered rows is beyond the rank: zeroed, not noise
    assert torch.equal(state["prompt_components"][5], torch.zeros(48, dtype=torch.float64))
    small = RolloutFeatures(torch.randn(50, 8), torch.randn(50, 8), torch.rand(50, 3))
    narrow = LinearValueProbe().fit(small, torch.rand(50))
    assert len(narrow.feature_names) == 8 + 8 + 3
    one_row = LinearValueProbe().fit(small[:1], torch.tensor([0.25]))  # degenerate but defined
    assert torch.equal(one_row.predict(small[:3]), torch.full((3,), 0.25))
    same = RolloutFeatures(torch.full((3, 8), 0.1), torch.full((3, 8), 0.7), torch.full((3, 3), 0.3))
    flat = LinearValueProbe().fit(same, torch.tensor([0.0, 0.5, 1.0])).state_dict()
    assert not flat["prompt_components"].any() and not flat["coef"].any()  # rounding noise is not signal


def test_pca_signs_fixed_and_fit_deterministic():
    feats, y = synthetic(200)
    a = LinearValueProbe().fit(feats, y)
    b = LinearValueProbe().fit(feats, y)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert torch.equal(a.predict(feats), b.predict(feats))
    a.fit(feats, y)  # refitting the same object starts from scratch
    assert torch.equal(a.predict(feats), b.predict(feats))
    comps = a.state_dict()["response_components"]
    nonzero = comps.abs().sum(1) > 0
    pivots = comps.gather(1, comps.abs().argmax(1, keepdim=True)).flatten()
    assert (pivots[nonzero] > 0).all()


def test_constant_feature_column_is_harmless():
    feats, y = synthetic(100)
    feats.entropy[:, 2] = 0.0  # e.g. no completion ever reached an answer span
    probe = LinearValueProbe(use_pca=False).fit(feats, y)
    state = probe.state_dict()
    assert state["feature_inv_scale"][-1] == 0 and state["coef"][-1] == 0
    assert torch.isfinite(probe.predict(feats)).all()


def test_probe_state_dict_round_trip_bit_identical(tmp_path):
    feats, y = synthetic(300)
    probe = LinearValueProbe(prompt_components=8, response_components=16).fit(feats, y)
    path = tmp_path / "probe.safetensors"
    safetensors.torch.save_file(probe.state_dict(), str(path))
    restored = LinearValueProbe(prompt_components=8, response_components=16)
    restored.load_state_dict(safetensors.torch.load_file(str(path)))
    test, _ = synthetic(100, seed=5)
    assert torch.equal(restored.predict(test), probe.predict(test))
    with pytest.raises(ValueError, match="use_pca=False"):
        LinearValueProbe(use_pca=False).load_state_dict(probe.state_dict())


def test_probe_errors():
    feats, y = synthetic(20)
    with pytest.raises(RuntimeError, match="not fitted"):
        LinearValueProbe().predict(feats)
    with pytest.raises(ValueError, match="20 rows and 19 targets"):
        LinearValueProbe().fit(feats, y[:19])
    with pytest.raises(ValueError, match="non-finite"):
        LinearValueProbe().fit(feats, torch.full((20,), float("nan")))
    with pytest.raises(ValueError, match="ridge_alpha"):
        LinearValueProbe(ridge_alpha=0.0)


# ---------------------------------------------------------------------------------------------
# GroupBuffer
# ---------------------------------------------------------------------------------------------


def rows(n: int, start: float = 0.0) -> tuple[RolloutFeatures, torch.Tensor]:
    """n rows whose prompt vector and target both carry the row's serial number."""
    serial = start + torch.arange(n, dtype=torch.float32)
    return RolloutFeatures(serial[:, None].repeat(1, 2), torch.zeros(n, 2), torch.zeros(n, 3)), serial


def test_buffer_evicts_whole_groups_oldest_first():
    buffer = GroupBuffer(capacity_rows=5)  # not a multiple of the group size 2
    buffer.append(*rows(6, 0), group_size=2)  # groups 0, 1, 2 -> only 2 whole groups fit
    assert len(buffer) == 4 and buffer.group_ids.tolist() == [1, 1, 2, 2]
    assert buffer.targets.tolist() == [2, 3, 4, 5]
    buffer.append(*rows(2, 6), group_size=2)  # group 3 arrives, group 1 (oldest) leaves
    assert buffer.group_ids.tolist() == [2, 2, 3, 3] and buffer.targets.tolist() == [4, 5, 6, 7]
    assert torch.equal(buffer.features.prompt[:, 0], buffer.targets)  # rows stay aligned
    buffer.append(*rows(3, 8), group_size=3)  # 4 + 3 rows: dropping group 2 is enough
    assert buffer.group_ids.tolist() == [3, 3, 4, 4, 4] and buffer.num_groups == 2
    buffer.append(*rows(3, 11), group_size=3)  # 5 + 3 rows: groups 3 and 4 must both go
    assert buffer.group_ids.tolist() == [5, 5, 5] and buffer.targets.tolist() == [11, 12, 13]
    with pytest.raises(ValueError, match="whole groups"):
        buffer.append(*rows(3, 0), group_size=2)
    with pytest.raises(ValueError, match="capacity 5"):
        buffer.append(*rows(6, 0), group_size=6)


def test_buffer_state_dict_round_trip():
    buffer = GroupBuffer(capacity_rows=8)
    empty = GroupBuffer(capacity_rows=8)
    empty.load_state_dict(buffer.state_dict())
    assert len(empty) == 0 and empty.features is None
    for step in range(3):
        buffer.append(*rows(4, 4 * step), group_size=2)
    restored = GroupBuffer(capacity_rows=8)
    restored.load_state_dict(buffer.state_dict())
    assert torch.equal(restored.targets, buffer.targets) and torch.equal(restored.group_ids, buffer.group_ids)
    assert torch.equal(restored.features.prompt, buffer.features.prompt)
    buffer.append(*rows(2, 100), group_size=2)
    restored.append(*rows(2, 100), group_size=2)
    assert torch.equal(restored.group_ids, buffer.group_ids)


# ---------------------------------------------------------------------------------------------
# ProbeEstimator
# ---------------------------------------------------------------------------------------------


def batches(steps: int, n: int = 32, seed: int = 0):
    """Per step: features and (pair-consistent) targets."""
    return [synthetic(n, d=16, seed=seed + s) for s in range(steps)]


def test_bootstrap_counting():
    est = ProbeEstimator(bootstrap_steps=3, capacity_rows=64)
    data = batches(4)
    for step, (feats, y) in enumerate(data[:3], start=1):
        pred, available = est.predict(feats)
        assert est.in_bootstrap and not available.any() and torch.isnan(pred).all()
        stats = est.update_from_targets(feats, y, group_size=2)
        assert est.steps_seen == step
        assert stats["refit_count"] == (1.0 if step == 3 else 0.0)
        assert ("insample_mae" in stats) == (step == 3)
    assert not est.in_bootstrap and est.refit_count == 1  # fit at the end of step 3
    pred, available = est.predict(data[3][0])
    assert available.all() and torch.isfinite(pred).all()
    assert est.update_from_targets(*data[3], group_size=2)["buffer_rows"] == 64.0


def test_predict_uses_previous_fit_only():
    est = ProbeEstimator(prompt_components=4, response_components=4, bootstrap_steps=2, capacity_rows=1000)
    data = batches(4)
    for feats, y in data[:3]:
        est.update_from_targets(feats, y, group_size=2)
    new_feats, new_y = data[3]
    pred, _ = est.predict(new_feats)
    # exactly a probe fitted from scratch on the rows of steps 1-3, without the new batch
    manual = LinearValueProbe(prompt_components=4, response_components=4).fit(
        RolloutFeatures.cat([f for f, _ in data[:3]]), torch.cat([y for _, y in data[:3]])
    )
    assert torch.equal(pred, manual.predict(new_feats))
    est.update_from_targets(new_feats, new_y, group_size=2)
    assert not torch.equal(est.predict(new_feats)[0], pred)


def test_update_uses_leave_one_out_targets():
    est = ProbeEstimator(bootstrap_steps=1)
    feats, _ = synthetic(6, d=8)
    est.update(feats, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), group_size=2)
    assert est.buffers["all"].targets.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # the partner's reward


def test_per_domain_probes():
    est = ProbeEstimator(bootstrap_steps=2, per_domain=True, prompt_components=4, response_components=4)
    (f1, y1), (f2, y2), (f3, y3) = batches(3, n=8)
    mixed = ["math"] * 4 + ["code"] * 4
    est.update_from_targets(f1, y1, 2, domains=mixed)
    est.update_from_targets(f2, y2, 2, domains=mixed)
    assert est.refit_counts == {"math": 1, "code": 1}
    code_state = est.probes["code"].state_dict()
    stats = est.update_from_targets(f3, y3, 2, domains=["math"] * 8)  # code absent: not refit
    assert est.refit_counts == {"math": 2, "code": 1} and "code/buffer_rows" not in stats
    assert stats["math/buffer_rows"] == 16.0
    assert all(torch.equal(t, code_state[k]) for k, t in est.probes["code"].state_dict().items())
    pred, available = est.predict(f3[:6], domains=["math", "math", "code", "code", "other", "other"])
    assert available.tolist() == [True, True, True, True, False, False]
    assert torch.isnan(pred[4:]).all() and torch.isfinite(pred[:4]).all()
    assert torch.equal(pred[2:4], est.probes["code"].predict(f3[2:4]))
    with pytest.raises(ValueError, match="one domain per group"):
        est.update_from_targets(f1, y1, 2, domains=["math", "code"] * 4)
    with pytest.raises(ValueError, match="per_domain=True"):
        est.predict(f1)
    with pytest.raises(ValueError, match="per_domain=False"):
        ProbeEstimator().predict(f1, domains=["math"] * 8)


def test_per_domain_bootstrap_is_global():
    """bootstrap_steps=3; steps: 1 math, 2 code, 3 math, 4 code, 5 other, 6 other.
    Bootstrap ends with step 3: math AND code are fit then (code was absent from step 3), so code's
    step 4 already uses a probe (with per-domain counters it would wait for its 3rd step, step 6).
    `other`, first seen at step 5, is fit at the end of step 5 and used from step 6."""
    est = ProbeEstimator(bootstrap_steps=3, per_domain=True, prompt_components=4, response_components=4)
    schedule = ["math", "code", "math", "code", "other", "other"]
    available_before, refits_after = [], []
    for step, (domain, (feats, y)) in enumerate(zip(schedule, batches(6, n=8), strict=True), start=1):
        available_before.append(bool(est.predict(feats, domains=[domain] * 8)[1].all()))
        stats = est.update_from_targets(feats, y, 2, domains=[domain] * 8)
        refits_after.append(dict(est.refit_counts))
        assert est.in_bootstrap == (step < 3)
        assert (f"{domain}/insample_mae" in stats) == (step >= 3)
    assert available_before == [False, False, False, True, False, True]
    assert refits_after == [
        {"math": 0},
        {"math": 0, "code": 0},
        {"math": 1, "code": 1},
        {"math": 1, "code": 2},
        {"math": 1, "code": 2, "other": 1},
        {"math": 1, "code": 2, "other": 2},
    ]
    assert est.domain_steps == {"math": 2, "code": 2, "other": 2}
    assert len(est.buffers["code"]) == 16 and len(est.buffers["other"]) == 16


@pytest.mark.parametrize("per_domain", [False, True])
def test_save_load_round_trip_bit_identical(tmp_path, per_domain):
    est = ProbeEstimator(bootstrap_steps=2, capacity_rows=48, per_domain=per_domain)
    domains = (["a"] * 16 + ["b"] * 16) if per_domain else None
    data = batches(5)
    for feats, y in data[:3]:
        est.update_from_targets(feats, y, 2, domains=domains)
    est.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["poise_probe.json", "poise_probe.safetensors"]
    meta = json.loads((tmp_path / "poise_probe.json").read_text())
    assert meta["steps_seen"] == 3 and meta["config"]["capacity_rows"] == 48 and "torch" in meta["versions"]
    loaded = ProbeEstimator.load(tmp_path)
    assert loaded.config == est.config and loaded.steps_seen == 3
    assert loaded.refit_counts == est.refit_counts and loaded.domain_steps == est.domain_steps
    for feats, y in data[3:]:  # the same future on both gives bit-identical predictions
        p_orig, a_orig = est.predict(feats, domains)
        p_load, a_load = loaded.predict(feats, domains)
        assert torch.equal(p_orig, p_load) and torch.equal(a_orig, a_load)
        est.update_from_targets(feats, y, 2, domains=domains)
        loaded.update_from_targets(feats, y, 2, domains=domains)


def test_load_failures_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"poise_probe\.json does not exist"):
        ProbeEstimator.load(tmp_path / "nowhere")
    est = ProbeEstimator(bootstrap_steps=1)
    est.update_from_targets(*synthetic(8, d=8), group_size=2)
    est.save(tmp_path)
    (tmp_path / "poise_probe.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"corrupt POISE probe tensors .*poise_probe\.safetensors"):
        ProbeEstimator.load(tmp_path)
    est.save(tmp_path)
    (tmp_path / "poise_probe.json").write_text("{truncated")
    with pytest.raises(ValueError, match=r"corrupt POISE probe metadata .*poise_probe\.json"):
        ProbeEstimator.load(tmp_path)
    est.save(tmp_path)
    stale = (tmp_path / "poise_probe.json").read_text()
    est.update_from_targets(*synthetic(8, d=8), group_size=2)
    est.save(tmp_path)
    (tmp_path / "poise_probe.json").write_text(stale)  # a json from another step
    with pytest.raises(ValueError, match="does not belong with"):
        ProbeEstimator.load(tmp_path)
    (tmp_path / "poise_probe.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"poise_probe\.safetensors does not exist"):
        ProbeEstimator.load(tmp_path)


# ---------------------------------------------------------------------------------------------
# probe_metrics
# ---------------------------------------------------------------------------------------------


def test_probe_metrics_by_hand():
    pred = torch.tensor([0.5, 0.0, 1.0, 0.25])
    target = torch.tensor([1.0, 0.0, 0.5, 0.5])
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0])
    baseline = torch.tensor([0.5, 0.5, 0.25, 0.0])
    m = probe_metrics(pred, target, reward, baseline)
    # errors (-0.5, 0, 0.5, -0.25); MSE 0.140625; Var(target) 0.125
    assert m["mae"] == pytest.approx(0.3125)
    assert m["rmse"] == pytest.approx(0.375)
    assert m["bias"] == pytest.approx(-0.0625)
    assert m["brier_skill"] == pytest.approx(1 - 0.140625 / 0.125)
    # centered pred (1, -7, 9, -3)/16, centered target (0.5, -0.5, 0, 0): cov 0.25, norms 0.546875, 0.5
    assert m["pearson"] == pytest.approx(0.25 / math.sqrt(0.546875 * 0.5))
    # pairs with distinct targets: (0,1) ok, (0,2) wrong, (0,3) ok, (1,2) ok, (1,3) ok; (2,3) tied target
    assert m["pairwise_sign_acc"] == pytest.approx(0.8)
    assert m["frac_clip_0"] == 0.25 and m["frac_clip_1"] == 0.25
    # advantages (0.5, -0.5, 0.75, 0): mean 0.1875, population var 0.23046875; Var(reward) 0.25
    assert m["adv_mean"] == pytest.approx(0.1875)
    assert m["adv_std"] == pytest.approx(math.sqrt(0.23046875))
    assert m["baseline_mean"] == pytest.approx(0.3125)
    assert m["variance_reduction"] == pytest.approx(1 - 0.23046875 / 0.25)


def test_probe_metrics_degenerate_inputs_give_nan_not_errors():
    tied = probe_metrics(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0]), torch.ones(2), torch.zeros(2))
    assert tied["pairwise_sign_acc"] == 0.0  # tied predictions on distinct targets count as wrong
    assert math.isnan(tied["pearson"]) and math.isnan(tied["variance_reduction"])  # constant pred, rewards
    const = probe_metrics(torch.tensor([0.2, 0.7]), torch.ones(2), torch.tensor([0.0, 1.0]), torch.zeros(2))
    assert math.isnan(const["brier_skill"]) and math.isnan(const["pairwise_sign_acc"])
    assert const["variance_reduction"] == 0.0
    empty = probe_metrics(*(torch.zeros(0) for _ in range(4)))
    assert len(empty) == 12 and all(math.isnan(v) for v in empty.values())
    single = probe_metrics(torch.tensor([0.3]), torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.3]))
    assert single["mae"] == pytest.approx(0.7) and math.isnan(single["pearson"])
