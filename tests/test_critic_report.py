"""The critic report on a hand-made history (no training)."""

from __future__ import annotations

import pytest

from poise_trl.algorithms.critic_report import critic_report, plot_critic_report, value_calibration


def record(step, ev, predicted, realised):
    return {"step": step, "explained_variance": ev, "explained_variance_prior": ev - 0.1,
            "explained_variance_first_token": ev, "explained_variance_prior_first_token": ev,
            "mc_sign_agreement": 1.0, "advantage_raw_std": 0.5, "adv_masked_fraction": 0.2,
            "entropy_filtered_fraction": 0.2, "value_loss": 0.25, "predicted_first_token": predicted,
            "prior_first_token": predicted, "realised_return": realised}


def test_value_calibration_bins_and_clamps():
    history = [record(0, 0.0, [0.05, 0.08, 0.55, -0.3], [0.0, 1.0, 1.0, 0.0]),
               record(1, 0.2, [0.51, 1.4], [0.0, 1.0])]
    bins = value_calibration(history)
    # bin 0: .05, .08 and -.3 (clamped in), realised 0, 1, 0; bin 5: .55, .51; bin 9: 1.4
    assert [b["count"] for b in bins] == [3, 2, 1]
    assert bins[0]["mean_realised"] == pytest.approx(1 / 3)
    assert bins[0]["mean_predicted"] == pytest.approx((0.05 + 0.08 - 0.3) / 3)
    assert bins[1]["mean_realised"] == pytest.approx(0.5) and bins[2]["mean_predicted"] == pytest.approx(1.4)


def test_report_halves_skip_nan_and_plot(tmp_path):
    history = [record(s, ev, [0.5], [1.0]) for s, ev in enumerate([0.0, float("nan"), 0.2, 0.4])]
    report = critic_report(history)
    assert report["rounds"] == 4
    assert report["mean"]["first_half"]["explained_variance"] == pytest.approx(0.0)  # nan skipped
    assert report["mean"]["second_half"]["explained_variance"] == pytest.approx(0.3)
    assert "predicted_first_token" not in report["per_round"][0]  # the long lists stay out of per_round
    plot_critic_report(report, history, tmp_path / "critic_values.png")
    assert (tmp_path / "critic_values.png").stat().st_size > 0
