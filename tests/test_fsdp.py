"""FSDP2 (`fully_shard`, 2 CPU processes over gloo) under the POISE feature hook and TRL's fused LM
head: the hook sees the full activations, and a training step matches the unsharded model exactly.

What is not run here: accelerate's own FSDP2 path (its MULTI_CPU state never enables FSDP, so a
whole `poise train` under recipes/accelerate/fsdp2.yaml, its sharded checkpoints and resume need
GPUs) and DeepSpeed (needs CUDA)."""

from pathlib import Path

import pytest
import torch
from helpers import run_two_cpu_ranks
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "distributed" / "fsdp2_two_ranks.py"


@pytest.mark.slow
def test_fsdp2_features_and_step_match_the_unsharded_model(tmp_path, tiny_random_model_dir):
    run_two_cpu_ranks(SCRIPT, tiny_random_model_dir, tmp_path, timeout=300)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # every rank sees the same features and weights
    result = ranks[0]
    hidden = 32  # tiny_random_model_dir's width: the hook pools full, unsharded hidden states
    assert result["sharded.prompt"].shape == result["sharded.response"].shape == (8, hidden)
    names = [k.removeprefix("reference.") for k in result if k.startswith("reference.")]
    assert any("embed_tokens" in n for n in names) and any("layers.1.mlp" in n for n in names)
    for name in names:
        assert torch.equal(result[f"reference.{name}"], result[f"sharded.{name}"]), name
    moved = result["reference.after_step.model.norm.weight"] - 1.0  # RMSNorm weights start at 1
    assert moved.abs().max() > 0  # the step did change the root's (unwrapped) parameters
