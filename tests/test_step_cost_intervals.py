"""benchmarks/step_cost.py's ratio of mean step times and its bootstrap interval (the figures docs quote), on
synthetic step times with a known ratio and with none."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_cost import ratio_interval  # noqa: E402  (a script under benchmarks/, not a package)


def replicates(ratio: float, count: int, steps: int, seed: int, step_noise: float = 0.05,
               replicate_noise: float = 0.1) -> tuple[list[list[float]], list[list[float]]]:
    """Paired step times of arms a and b: each replicate runs at its own speed (both arms share it), each step
    has its own noise, and a's steps take `ratio` times b's on average."""
    rng = random.Random(seed)
    a, b = [], []
    for _ in range(count):
        speed = 1 + rng.gauss(0, replicate_noise)
        a.append([ratio * speed * (1 + rng.gauss(0, step_noise)) for _ in range(steps)])
        b.append([speed * (1 + rng.gauss(0, step_noise)) for _ in range(steps)])
    return a, b


def test_a_known_ratio_lies_in_its_interval_away_from_one():
    ratio, low, high = ratio_interval(*replicates(1.1, count=4, steps=20, seed=0), resamples=2000, seed=0)
    assert ratio == pytest.approx(1.1, abs=0.02)
    assert 1 < low < 1.1 < high < 1.2


def test_identical_arms_give_an_interval_around_one():
    held = 0
    for seed in range(20):
        times = replicates(1.0, count=4, steps=20, seed=seed)
        ratio, low, high = ratio_interval(*times, resamples=500, seed=seed)
        held += low < 1 < high
        assert ratio == pytest.approx(1.0, abs=0.05)
    assert held >= 17  # 95% nominal


def test_replicates_that_disagree_widen_the_interval():
    """Two replicates whose ratios differ (1.0 and 1.2) with hardly any step noise: redrawing the replicates
    spreads the interval over both; redrawing steps alone would leave it a few thousandths wide."""
    a = [[1.0 + 0.001 * i for i in range(20)], [1.2 + 0.001 * i for i in range(20)]]
    b = [[1.0 + 0.001 * i for i in range(20)], [1.0 + 0.001 * i for i in range(20)]]
    ratio, low, high = ratio_interval(a, b, resamples=2000, seed=0)
    assert ratio == pytest.approx(1.1, abs=0.001)
    assert low == pytest.approx(1.0, abs=0.01) and high == pytest.approx(1.2, abs=0.01)
