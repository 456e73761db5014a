"""benchmarks/plan_vs_measured.py: the peak of live tensor bytes inside and outside generation."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from plan_vs_measured import window_peaks  # noqa: E402  (a script under benchmarks/, not a package)


def test_window_peaks_split_generation_from_the_rest_of_the_step():
    events = [
        (0, 100),  # weights, before the step
        (15, 50), (18, -50),  # generation: a KV cache, freed
        (25, 30),  # training: activations
        (26, 40), (27, -70),  # more, then the activations freed
        (40, 999),  # after the step: not counted
    ]
    peaks = window_peaks(events, step=(10, 30), generation=[(12, 20)])
    assert peaks == {"training_peak_bytes": 170, "generation_peak_bytes": 150,
                     "live_bytes_at_generation_start": 100}


def test_without_generation_every_event_of_the_step_is_training():
    peaks = window_peaks([(5, 10), (11, 5)], step=(0, 20), generation=[])
    assert peaks == {"training_peak_bytes": 15, "generation_peak_bytes": 0,
                     "live_bytes_at_generation_start": None}
