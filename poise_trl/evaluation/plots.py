"""The figures of `poise probe-eval`: predicted vs empirical value per prompt, the layer sweep, and the probe's
transfer across tasks."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from poise_trl.core.provenance import pyplot


def plot_predictions(path: Path, empirical: torch.Tensor, predictions: dict[str, torch.Tensor],
                     metrics: dict[str, dict], n: int) -> Path:
    """Predicted vs empirical Avg@n per held-out prompt, one panel per estimator."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(predictions), figsize=(4.2 * len(predictions), 4.2), squeeze=False)
    for ax, (name, pred) in zip(axes[0], predictions.items(), strict=True):
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
        ax.scatter(empirical.numpy(), pred.numpy(), s=14, alpha=0.7)
        m = metrics[name]
        ax.set_title(f"{name}\nPearson {m['pearson']:.3f}, MAE {m['mae']:.3f}", fontsize=10)
        ax.set_xlabel(f"empirical Avg@{n}")
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(-0.03, 1.03)
    axes[0][0].set_ylabel("predicted value (mean over the prompt's rollouts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_layer_sweep(path: Path, sweep: list[dict], references: dict[str, dict]) -> Path:
    """Held-out Pearson and MAE of the probe against block depth, with the baselines as lines."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    depths = [s["depth"] for s in sweep]
    for ax, metric in zip(axes, ("pearson", "mae"), strict=True):
        ax.plot(depths, [s["metrics"][metric] for s in sweep], marker="o", label="probe")
        for (name, m), color in zip(references.items(), ("tab:red", "tab:grey"), strict=False):
            if math.isfinite(m[metric]):
                ax.axhline(m[metric], color=color, ls="--", lw=1, label=name)
        ax.set_xlabel("depth of the hooked block (block + 1) / L")
        ax.set_ylabel(f"held-out {metric}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_transfer(path: Path, transfer: dict, n: int) -> Path:
    """Heatmap of the held-out Pearson of a probe fit on one task (row) and scored on another (column),
    with Pearson and MAE printed in each cell; an undefined Pearson (a constant side) is grey, "n/a"."""
    plt = pyplot()
    tasks, pearson, mae = transfer["tasks"], transfer["pearson"], transfer["mae"]
    size = 1.6 + 1.3 * len(tasks)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    cmap = plt.get_cmap("RdBu").with_extremes(bad="lightgrey")
    values = [[r if r is not None and math.isfinite(r) else math.nan for r in row] for row in pearson]
    image = ax.imshow(values, cmap=cmap, vmin=-1, vmax=1)
    for i, row in enumerate(values):
        for j, r in enumerate(row):
            text = "n/a" if math.isnan(r) else f"{r:.2f}"
            ax.text(j, i, f"{text}\nMAE {mae[i][j]:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if abs(r) > 0.6 else "black")
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(tasks)), tasks, fontsize=8)
    ax.set_xlabel("evaluated on (held-out prompts)")
    ax.set_ylabel("probe fit on (train prompts)")
    ax.set_title(f"probe transfer: Pearson vs Avg@{n}", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long task names: grow the canvas, not clip them
    plt.close(fig)
    return path
