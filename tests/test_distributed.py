"""Two CPU processes (gloo): features and rewards are gathered, so both ranks fit the same probe."""

from pathlib import Path

import pytest
import torch
from helpers import run_two_cpu_ranks
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "distributed" / "poise_two_ranks.py"


@pytest.mark.slow
def test_two_ranks_end_with_identical_probe_weights(tmp_path, tiny_random_model_dir):
    run_two_cpu_ranks(SCRIPT, tiny_random_model_dir, tmp_path, timeout=600)
    rank0 = load_file(tmp_path / "rank0" / "poise_probe.safetensors")
    rank1 = load_file(tmp_path / "rank1" / "poise_probe.safetensors")
    assert rank0.keys() == rank1.keys() and any(".probe." in k for k in rank0)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    # Both ranks' rows are in the buffer: 3 rounds x 2 processes x 4 rows.
    buffer_targets = [k for k in rank0 if k.endswith("buffer.targets")]
    assert rank0[buffer_targets[0]].numel() == 24
