"""The critic diagnostic of AsyPPO / PPO / VAPO: `critic_report.json` and `critic_values.png`.

Written at the end of training from `AsyPPOTrainer.critic_history` (one record per round): explained
variance over training, V(s_0) against the realised return, sign agreement with the Monte-Carlo advantage
and the fractions AsyPPO's masks select (also logged as `critic/*`, `advantages/raw_std`, `asyppo/*`).
"""

from __future__ import annotations

from pathlib import Path

from poise_trl.algorithms.base import RunCallback
from poise_trl.core.metrics import mean_or_none
from poise_trl.core.provenance import pyplot, write_json

SERIES = ("explained_variance", "explained_variance_prior", "explained_variance_first_token",
          "explained_variance_prior_first_token", "mc_sign_agreement", "advantage_raw_std", "adv_masked_fraction",
          "entropy_filtered_fraction", "value_loss")


def value_calibration(records: list[dict], key: str = "predicted_first_token", bins: int = 10) -> list[dict]:
    """Predicted V(s_0) binned on [0, 1] (values outside go to the end bins), with the mean
    realised return of each bin: on the diagonal when the critics are calibrated."""
    sums, pred_sums, counts = [0.0] * bins, [0.0] * bins, [0] * bins
    for record in records:
        for p, r in zip(record[key], record["realised_return"], strict=True):
            b = min(max(int(p * bins), 0), bins - 1)
            sums[b] += r
            pred_sums[b] += p
            counts[b] += 1
    return [{"mean_predicted": pred_sums[b] / counts[b], "mean_realised": sums[b] / counts[b], "count": counts[b]}
            for b in range(bins) if counts[b]]


def critic_report(history: list[dict]) -> dict:
    """Per-round series, their means over each half of training, and the calibration bins."""
    half = len(history) // 2
    halves = {"first_half": history[:half], "second_half": history[half:]}
    return {
        "rounds": len(history),
        "mean": {name: {k: mean_or_none([r.get(k) for r in part]) for k in SERIES} for name, part in halves.items()},
        "calibration_used": value_calibration(history),
        "calibration_prior": value_calibration(history, "prior_first_token"),
        "per_round": [{k: v for k, v in r.items() if not isinstance(v, list)} for r in history],
    }


def plot_critic_report(report: dict, history: list[dict], path: str | Path) -> None:
    plt = pyplot()
    steps = [r["step"] for r in history]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("explained_variance", "values GAE used"), ("explained_variance_prior", "before the fit"),
                       ("explained_variance_first_token", "V(s_0), used")):
        left.plot(steps, [r[key] for r in history], label=label)
    left.axhline(0.0, color="k", lw=0.5)
    left.set(xlabel="step", ylabel="explained variance", title="critic fit over training")
    left.legend()
    middle.plot([0, 1], [0, 1], "k--", lw=1, label="calibrated")
    for key, label in (("calibration_used", "used"), ("calibration_prior", "before the fit")):
        bins = report[key]
        middle.plot([c["mean_predicted"] for c in bins], [c["mean_realised"] for c in bins], "o-", label=label)
    middle.set(xlabel="critics' V(s_0) (binned)", ylabel="mean realised return",
               title="predicted vs realised return", xlim=(0, 1), ylim=(0, 1))
    middle.legend()
    for key, label in (("mc_sign_agreement", "sign agreement with r - mean_group(r)"),
                       ("adv_masked_fraction", "advantage masked (I^A)"),
                       ("entropy_filtered_fraction", "entropy filtered (I^H)")):
        right.plot(steps, [r[key] for r in history], label=label)
    right.set(xlabel="step", ylim=(-0.02, 1.02), title="advantages and masks")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class CriticReportCallback(RunCallback):
    """At the end of training: `critic_report.json`, `critic_values.png` (a resumed run: from its resume)."""

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.trainer.critic_history:
            return
        history = self.trainer.critic_history
        report = critic_report(history)
        report["critic_config"] = {k: v for k, v in args.to_dict().items() if k.startswith(("critic", "num_critics"))}
        out = Path(self.output_dir)
        write_json(out / "critic_report.json", report)
        plot_critic_report(report, history, out / "critic_values.png")
