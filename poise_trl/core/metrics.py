"""Metrics that training and evaluation share: correlation, calibration, pass@k and bootstrap intervals.
Pure functions of tensors or counts; nothing here knows a model or a run."""

from __future__ import annotations

import math

import torch


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation; NaN when either side is constant (or there are no rows)."""
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(a.pow(2).sum()) * float(b.pow(2).sum()))
    return float((a * b).sum()) / denom if denom > 0 else float("nan")


def mae(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float((pred.double() - target.double()).abs().mean())


def rmse(pred: torch.Tensor, target: torch.Tensor) -> float:
    return math.sqrt(float((pred.double() - target.double()).pow(2).mean()))


def brier_skill(pred: torch.Tensor, target: torch.Tensor) -> float:
    """1 - MSE / Var(target) (population variance): 0 is predicting the set's mean; NaN if it is constant."""
    var = float(target.double().var(unbiased=False))
    return 1.0 - rmse(pred, target) ** 2 / var if var > 0 else float("nan")


def ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties sharing their average rank: #smaller + (#equal + 1) / 2."""
    x = x.double()
    return (x[:, None] > x[None, :]).sum(1) + ((x[:, None] == x[None, :]).sum(1) + 1) / 2


def spearman(pred: torch.Tensor, target: torch.Tensor) -> float:
    return pearson(ranks(pred), ranks(target))


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting 1/2; NaN without both classes."""
    labels = labels.bool()
    pos, neg = scores.double()[labels], scores.double()[~labels]
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


def calibration_error(prob: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: |share right - mean probability| over `bins` equal-width bins, weighted
    by their rows."""
    prob, labels = prob.double(), labels.double()
    which = (prob * bins).long().clamp(0, bins - 1)
    gaps = [float((which == b).sum() * (labels[which == b].mean() - prob[which == b].mean()).abs())
            for b in which.unique()]
    return sum(gaps) / prob.numel()


def correctness_metrics(pred: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """A value prediction read as the probability that its rollout is right: AUROC against the binary
    outcome, Brier score and expected calibration error (predictions clipped to [0, 1])."""
    prob = pred.double().clamp(0, 1)
    return {"auroc": auroc(pred, correct), "brier": float((prob - correct.double()).pow(2).mean()),
            "ece": calibration_error(prob, correct), "share_right": float(correct.double().mean())}


def pearson_ci95(r: float, n: int) -> list[float]:
    """Fisher-z 95% interval of a Pearson r from n pairs (NaN for n < 4 or an undefined r)."""
    if n < 4 or not math.isfinite(r):
        return [float("nan"), float("nan")]
    z, half = math.atanh(max(-1 + 1e-12, min(1 - 1e-12, r))), 1.96 / math.sqrt(n - 3)
    return [math.tanh(z - half), math.tanh(z + half)]


def value_metrics(pred: torch.Tensor, target: torch.Tensor) -> dict[str, float | list[float]]:
    """Quality of value predictions against targets in [0, 1]; AUROC ranks "solved at least once"."""
    r = pearson(pred.double(), target.double())
    return {
        "mae": mae(pred, target),
        "rmse": rmse(pred, target),
        "pearson": r,
        "pearson_ci95": pearson_ci95(r, pred.numel()),
        "spearman": spearman(pred, target),
        "brier_skill": brier_skill(pred, target),
        "auroc_solved": auroc(pred, target > 0),
    }


def paired_bootstrap(
    pred_a: torch.Tensor, pred_b: torch.Tensor, target: torch.Tensor, n_boot: int = 2000, seed: int = 0
) -> dict[str, dict]:
    """metric(a) - metric(b) for Pearson and MAE, with a 95% interval from resampling the shared prompts."""
    a, b, t = pred_a.double(), pred_b.double(), target.double()
    draws = torch.randint(t.numel(), (n_boot, t.numel()), generator=torch.Generator().manual_seed(seed))
    out = {}
    for name, fn in (("pearson", pearson), ("mae", mae)):
        diffs = torch.tensor([fn(a[i], t[i]) - fn(b[i], t[i]) for i in draws], dtype=torch.float64)
        diffs = diffs[diffs.isfinite()]  # a resample where one side is constant has no Pearson
        interval = diffs.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist() if diffs.numel() else []
        out[name] = {"diff": fn(a, t) - fn(b, t), "ci95": interval}
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


def mean_and_stderr(values: list[float]) -> dict:
    """Mean over problems and its standard error: a benchmark is a sample of problems."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return {"value": mean, "stderr": math.sqrt(var / len(values))}


def mean_or_none(values: list[float | None]) -> float | None:
    """The mean of the values that are neither None nor NaN; None when there are none."""
    finite = [v for v in values if v is not None and v == v]
    return sum(finite) / len(finite) if finite else None


def calibration_bins(records: list[dict], bins: int = 10) -> list[dict]:
    """Out-of-sample predictions binned by value, with the mean realized reward of each bin."""
    sums, pred_sums, counts = [0.0] * bins, [0.0] * bins, [0] * bins
    for record in records:
        for p, t in zip(record["predictions"], record["targets"], strict=True):
            b = min(int(p * bins), bins - 1)
            sums[b] += t
            pred_sums[b] += p
            counts[b] += 1
    return [
        {"mean_predicted": pred_sums[b] / counts[b], "mean_realized": sums[b] / counts[b], "count": counts[b]}
        for b in range(bins)
        if counts[b]
    ]
