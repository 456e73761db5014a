"""How each arm's update size follows the reward signal, read from `poise compare` run folders.

For every arm folder given (one `seed*/summary.json` per seed, as `poise compare` writes), the
mean gradient norm over steps where at least 75% of the groups carried no signal (all rewards
of the prompt equal) and over steps where at most 50% did. GRPO's advantage of such a group is
exactly 0, so its gradient shrinks with the signal; whitened AsyPPO advantages are rescaled to
unit variance every batch, so the critics' residual noise takes the place of the missing
signal (issue 17; benchmarks/results/asyppo_diagnosis.md, section 6). Also, from each seed's
step-0 held-out evaluation, the share of the reward variance that the per-level success rates
explain: what a perfect value of the prompt could reach on that task.

    python benchmarks/critic_signal_scale.py runs/spread300k/runs/grpo runs/spread300k/runs/asyppo

Writes benchmarks/results/critic_signal_scale.json (--output to change) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from poise_trl.core.provenance import package_versions, write_json

MOSTLY_SILENT, MOSTLY_INFORMATIVE = 0.75, 0.5


def level_value_share(evaluation: dict) -> float | None:
    """Variance of the per-level success rates over the reward variance p(1-p), levels equally weighted."""
    rates = list(evaluation.get("by_level", {}).values())
    if len(rates) < 2:
        return None
    mean = statistics.fmean(rates)
    return statistics.pvariance(rates) / (mean * (1 - mean)) if 0 < mean < 1 else None


def arm_signals(folder: Path) -> dict:
    summaries = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*/summary.json"))]
    if not summaries:
        raise SystemExit(f"{folder}: no seed*/summary.json; give an arm folder of a finished `poise compare` run")
    silent, informative, shares = [], [], []
    for summary in summaries:
        for entry in summary["train_log"]:
            if entry.get("grad_norm") is None or entry.get("frac_reward_zero_std") is None:
                continue
            if entry["frac_reward_zero_std"] >= MOSTLY_SILENT:
                silent.append(entry["grad_norm"])
            elif entry["frac_reward_zero_std"] <= MOSTLY_INFORMATIVE:
                informative.append(entry["grad_norm"])
        shares.append(level_value_share(summary["heldout_history"][0]))

    def mean(values):
        return statistics.fmean(values) if values else None

    silent_mean, informative_mean = mean(silent), mean(informative)
    return {
        "seeds": [s["recipe"]["seed"] for s in summaries],
        "dataset": summaries[0]["dataset"],
        "grad_norm_mostly_silent_steps": silent_mean,
        "mostly_silent_steps": len(silent),
        "grad_norm_mostly_informative_steps": informative_mean,
        "mostly_informative_steps": len(informative),
        "ratio": silent_mean / informative_mean if silent_mean is not None and informative_mean else None,
        "level_value_share_at_start": [s for s in shares if s is not None],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", type=Path, help="arm folders: <compare -o>/runs/<arm>")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "critic_signal_scale.json")
    args = parser.parse_args()
    arms = {str(folder): arm_signals(folder) for folder in args.arms}

    def num(value):
        return "-" if value is None else f"{value:.3f}"

    print(f"{'arm':48} {'silent steps':>14} {'informative':>14} {'ratio':>6}  level-value share at start")
    for name, a in arms.items():
        print(f"{name:48} {num(a['grad_norm_mostly_silent_steps']):>8} ({a['mostly_silent_steps']:3}) "
              f"{num(a['grad_norm_mostly_informative_steps']):>8} ({a['mostly_informative_steps']:3}) "
              f"{num(a['ratio']):>6}  {' '.join(num(s) for s in a['level_value_share_at_start'])}")
    write_json(args.output, {"thresholds": {"mostly_silent": MOSTLY_SILENT, "mostly_informative": MOSTLY_INFORMATIVE},
                             "arms": arms, "versions": package_versions()})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
