"""FSDP2 on 2 CPU processes (gloo).

- `fully_shard` under the POISE feature hook and TRL's fused LM head: the hook sees the full
  activations, and a training step matches the unsharded model exactly.
- `poise train`'s `train_from_recipe` for POISE and AsyPPO launched with accelerate and the shipped
  recipes/accelerate/fsdp2.yaml, through accelerate's own FSDP2 path (see
  distributed/fsdp2_train.py for the one decision changed so that it runs without a GPU): it
  trains, evaluates, checkpoints (full, and sharded per process), and a run resumed from its
  step-2 checkpoint ends bit-identical to the uninterrupted one (weights, probe, critics).
- GRPO, RLOO, DAPO, REINFORCE++, POISE, PPO, VAPO and AsyPPO train 2 steps each under the same
  launch, with POISE's probe and the critics identical on both processes.

Not run here: DeepSpeed (its ZeRO engines need CUDA), bf16 mixed precision (fp32 on a CPU) and
A*-PO (TRL's experimental trainer) under FSDP."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_accelerate_launch, run_two_cpu_ranks
from safetensors.torch import load_file

from poise_trl.core.loading import resolve_model_path
from poise_trl.run.recipe import load_recipe

SCRIPT = Path(__file__).parent / "distributed" / "fsdp2_two_ranks.py"
TRAIN_SCRIPT = Path(__file__).parent / "distributed" / "fsdp2_train.py"
REPO = Path(__file__).resolve().parents[1]
FSDP2_CONFIG = REPO / "recipes" / "accelerate" / "fsdp2.yaml"


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


def fsdp2_recipe(algo: str, **changes) -> dict:
    """recipes/toy/ALGO.yaml as shipped (bundled tiny model and critic), shortened to 4 steps of 4
    prompts x 2 rollouts per process with a checkpoint every 2 steps, then `changes`."""
    recipe = load_recipe(REPO / "recipes" / "toy" / f"{algo}.yaml")
    for key in ("model", "critic_model"):
        if key in recipe:
            recipe[key] = resolve_model_path(recipe[key])
    recipe.update(num_generations=2, per_device_train_batch_size=4, critic_mini_batch_size=2, max_completion_length=16,
                  dataset_size=32, eval_limit=4, eval_every=2, eval_num_samples=1, eval_max_new_tokens=16,
                  max_steps=4, logging_steps=1, save_steps=2)
    if algo == "poise":
        recipe.update(probe_bootstrap_steps=1, probe_prompt_components=2, probe_response_components=2)
    if "value_warmup_steps" in recipe:
        recipe["value_warmup_steps"] = 1  # VAPO: the actor trains from step 2
    recipe.update(changes)
    critics = algo in ("asyppo", "ppo", "vapo")
    return {k: v for k, v in recipe.items() if critics or k != "critic_mini_batch_size"}


def state_files(checkpoint: Path) -> dict[str, bytes]:
    """The model, probe and critic state of a checkpoint (not its clocks or pickled optimizer)."""
    return {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*"))
            if p.suffix == ".safetensors" or p.name in ("poise_probe.json", "probe_history.json")}


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "state_dict_type"), [("poise", "FULL_STATE_DICT"), ("asyppo", "SHARDED_STATE_DICT")])
def test_accelerate_fsdp2_run_checkpoints_and_resumes_bit_identically(algo, state_dict_type, tmp_path):
    """fsdp2.yaml as shipped (full checkpoints) for POISE; for AsyPPO with accelerate's
    --fsdp_state_dict_type SHARDED_STATE_DICT, where every process writes its own shard. A resumed
    run loads process 0's critics everywhere, so it also catches critics that differ between
    processes (as they did when only process 0 read their weights)."""
    recipe = fsdp2_recipe(algo)
    launch_args = () if state_dict_type == "FULL_STATE_DICT" else ("--fsdp_state_dict_type", state_dict_type)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_accelerate_launch(FSDP2_CONFIG, TRAIN_SCRIPT, json.dumps(recipe), whole, launch_args=launch_args)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["steps"] == 4 and [p["step"] for p in summary["heldout_history"]] == [0, 2, 4]
    if state_dict_type == "FULL_STATE_DICT":
        assert (whole / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()  # accelerate's FSDP save, not DDP's
    else:
        assert len(list((whole / "checkpoint-2" / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # one per process
        assert len(list((whole / "checkpoint-2" / "optimizer_0").glob("*.distcp"))) == 2
    # What an interruption after the step-2 checkpoint leaves behind: the recipe and that checkpoint.
    resumed.mkdir()
    shutil.copy(whole / "recipe.yaml", resumed / "recipe.yaml")
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    run_accelerate_launch(FSDP2_CONFIG, TRAIN_SCRIPT, json.dumps(recipe), resumed, launch_args=launch_args)
    again = json.loads((resumed / "summary.json").read_text())
    assert again["resumed_at_steps"] == [2]
    assert [p["accuracy"] for p in again["heldout_history"]] == [p["accuracy"] for p in summary["heldout_history"]]
    assert (again["generated_tokens"], again["generated_rollouts"]) == (summary["generated_tokens"],
                                                                      summary["generated_rollouts"])
    expected, got = state_files(whole / "checkpoint-4"), state_files(resumed / "checkpoint-4")
    assert expected.keys() == got.keys()
    assert any(("probe" if algo == "poise" else "critic") in name for name in expected), sorted(expected)
    for name in expected:
        assert got[name] == expected[name], name
    # final/ holds the full model whichever checkpoint format the launch used.
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "final weights differ"


@pytest.mark.slow
def test_every_algorithm_trains_under_accelerate_fsdp2_with_identical_replicas(tmp_path):
    """The baselines and the critic arms, 2 steps each, in one 2-process launch: each trains, and
    the replicated state (POISE's probe, the critics) is identical on both processes."""
    algos = ["grpo", "rloo", "dapo", "reinforce_pp", "poise", "ppo", "vapo", "asyppo"]
    recipes = [fsdp2_recipe(algo, max_steps=2, save_steps=100, eval_every=0) for algo in algos]
    run_accelerate_launch(FSDP2_CONFIG, TRAIN_SCRIPT, json.dumps(recipes), tmp_path, "rank-state", timeout=900)
    for index, algo in enumerate(algos):
        folder = tmp_path / f"{index}-{algo}"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["generated_rollouts"] > 0, algo
        if algo == "poise":
            ranks = [load_file(folder / f"rank{r}-probe" / "poise_probe.safetensors") for r in (0, 1)]
            assert any(".probe." in key for key in ranks[0]), sorted(ranks[0])  # fitted after its bootstrap step
        elif algo in ("ppo", "vapo", "asyppo"):
            ranks = [load_file(folder / f"rank{r}-critics.safetensors") for r in (0, 1)]
        else:
            continue
        assert ranks[0].keys() == ranks[1].keys()
        for key in ranks[0]:
            assert torch.equal(ranks[0][key], ranks[1][key]), (algo, key)
