"""poise_trl.algorithms.critics: value heads, the fit, checkpoints, and gradient sync over 2 processes."""

from __future__ import annotations

import json
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import run_two_cpu_ranks

from poise_trl.algorithms.critics import CriticEnsemble, enable_activation_checkpointing, load_critic, token_values
from poise_trl.core.loading import BUNDLED_DATA
from poise_trl.run.toy import build_tiny_critic


def ensemble(model_dir, num_critics=2, **kwargs):
    settings = dict(learning_rate=1e-2, mini_batch_size=4, seed=0)
    settings.update(kwargs)
    return CriticEnsemble(str(model_dir), num_critics, **settings)


def toy_batch(rows=8, prompt=5, completion=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (rows, prompt + completion), generator=gen)
    attention = torch.ones_like(ids)
    attention[: rows // 2, :2] = 0  # left padding on half the prompts
    mask = torch.ones(rows, completion)
    mask[1, 3:] = 0
    attention[1, prompt + 3 :] = 0
    targets = torch.rand(rows, completion, generator=gen)
    return ids, attention, mask, targets


def test_fresh_heads_are_seeded_and_a_saved_critic_loads_as_is(tiny_random_model_dir, tmp_path):
    a, b, a_again = (load_critic(str(tiny_random_model_dir), seed) for seed in (0, 1, 0))
    assert torch.equal(a.score.weight, a_again.score.weight)
    assert not torch.equal(a.score.weight, b.score.weight)
    assert a.dropout.p == 0.0
    a.save_pretrained(tmp_path / "critic")
    for seed in (0, 5):  # a value model keeps its trained head whatever the seed
        assert torch.equal(load_critic(str(tmp_path / "critic"), seed).score.weight, a.score.weight)


def test_values_ignore_left_padding(tiny_random_model_dir):
    critic = load_critic(str(tiny_random_model_dir), 0)
    ids = torch.randint(10, 60, (1, 9))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    attention = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = token_values(critic, ids, torch.ones_like(ids), 4)
        shifted = token_values(critic, padded, attention, 4)
    assert plain.shape == (1, 4)
    torch.testing.assert_close(plain, shifted, atol=1e-5, rtol=0)


def test_each_critic_fits_only_its_rows_and_the_loss_falls(tiny_random_model_dir):
    critics = ensemble(tiny_random_model_dir)
    ids, attention, mask, targets = toy_batch()
    untouched = [p.clone() for p in critics.critics[1].parameters()]
    everything_to_0 = torch.zeros(8, dtype=torch.long)
    losses = [critics.update(ids, attention, 6, targets, mask, everything_to_0)["value_loss_0"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    assert all(torch.equal(p, q) for p, q in zip(untouched, critics.critics[1].parameters(), strict=True))
    assert critics.updates == 15
    values = critics.values(ids, attention, 6)
    assert values.shape == (2, 8, 6)


def test_save_and_load_round_trip(tiny_random_model_dir, tmp_path):
    ids, attention, mask, targets = toy_batch()
    assignment = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    trained = ensemble(tiny_random_model_dir)
    trained.update(ids, attention, 6, targets, mask, assignment)
    trained.save(tmp_path)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["num_critics"] == 2 and state["updates"] == 1
    assert sorted(p.name for p in (tmp_path / "critic_0").iterdir()) == [
        "config.json", "model.safetensors", "optimizer.safetensors"
    ]
    restored = ensemble(tiny_random_model_dir)
    restored.load(tmp_path)
    assert torch.equal(restored.values(ids, attention, 6), trained.values(ids, attention, 6))
    # Same AdamW moments and the same shuffling generator: the next update is identical too.
    assert restored.update(ids, attention, 6, targets, mask, assignment) == trained.update(
        ids, attention, 6, targets, mask, assignment
    )
    for mine, theirs in zip(restored.critics, trained.critics, strict=True):
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p, q)
    with pytest.raises(ValueError, match="holds 2 critics"):
        ensemble(tiny_random_model_dir, num_critics=1).load(tmp_path)


def test_build_tiny_critic_from_the_actor(tiny_random_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    card = build_tiny_critic(tmp_path / "critic", actor_dir=tiny_random_model_dir, num_layers=1, seed=3)
    assert card["num_layers"] == 1 and (tmp_path / "critic" / "tokenizer.json").exists()
    actor = AutoModelForCausalLM.from_pretrained(tiny_random_model_dir)
    critic = load_critic(str(tmp_path / "critic"), seed=0)
    assert critic.config.num_hidden_layers == 1 and critic.config.num_labels == 1
    assert torch.equal(critic.model.embed_tokens.weight, actor.model.embed_tokens.weight)
    assert torch.equal(critic.model.layers[0].mlp.up_proj.weight, actor.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(critic.model.norm.weight, actor.model.norm.weight)
    assert card["parameters"] < sum(p.numel() for p in actor.parameters())

    random_card = build_tiny_critic(tmp_path / "random", num_layers=2, hidden_size=32)
    assert random_card["init"] == "random" and load_critic(str(tmp_path / "random"), 0).config.hidden_size == 32


# -- two processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_rank_worker(rank, model_dir, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ids, attention, mask, targets = toy_batch(rows=8)
    rows = slice(4 * rank, 4 * rank + 4)  # each rank holds one prompt group of 4
    critics = ensemble(model_dir, mini_batch_size=4)
    assignment = torch.tensor([0, 0, 1, 1])
    for _ in range(2):
        metrics = critics.update(ids[rows], attention[rows], 6, targets[rows], mask[rows], assignment)
    torch.save({"params": [p.detach().clone() for c in critics.critics for p in c.parameters()], "metrics": metrics},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_processes_hold_identical_critics_equal_to_one_process_on_all_rows(tiny_random_model_dir, tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tiny_random_model_dir), _free_port(), str(tmp_path)), nprocs=2)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for p, q in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(p, q)
    assert rank0["metrics"] == rank1["metrics"]
    # One process on both groups with one mini-batch per critic: the same steps.
    ids, attention, mask, targets = toy_batch(rows=8)
    single = ensemble(tiny_random_model_dir, mini_batch_size=4)
    for _ in range(2):
        metrics = single.update(ids, attention, 6, targets, mask, torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]))
    assert metrics["value_loss"] == pytest.approx(rank0["metrics"]["value_loss"], rel=1e-5)
    params = [p for c in single.critics for p in c.parameters()]
    for p, q in zip(params, rank0["params"], strict=True):
        torch.testing.assert_close(p.detach(), q, atol=1e-5, rtol=1e-3)


TRAINER_SCRIPT = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, {tests!r})
from helpers import assert_parameters_moved, trainable_parameters
from test_asyppo import make_trainer, parity

out = Path({out!r})
trainer = make_trainer({model!r}, out / "run", reward_funcs=[parity], per_device_train_batch_size=4, max_steps=2,
                       save_steps=100)
before = trainable_parameters(trainer)
trainer.train()
assert_parameters_moved(before, trainer)
params = [p.detach().clone() for critic in trainer.critics.critics for p in critic.parameters()]
torch.save({{"params": params, "updates": trainer.critics.updates}},
           out / f"rank{{trainer.accelerator.process_index}}.pt")
# Tear gloo down before exit: its threads otherwise can abort the process at interpreter shutdown.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_rank_asyppo_training_keeps_the_critics_identical(tiny_random_model_dir, tmp_path):
    """2 processes (gloo): each rank fits its own rows, the summed gradients keep both ranks'
    critics bit-identical."""
    from pathlib import Path

    script = tmp_path / "two_ranks.py"
    script.write_text(TRAINER_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path),
                                            model=str(tiny_random_model_dir)))
    run_two_cpu_ranks(script)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["updates"] == rank1["updates"] == 2
    assert all(torch.equal(p, q) for p, q in zip(rank0["params"], rank1["params"], strict=True))


def test_a_critics_activation_checkpointing_is_switched_on_without_a_deprecation_warning():
    """transformers 5.24 renamed gradient checkpointing (and warns on the old name); CI's second leg runs it."""
    critic = load_critic(str(BUNDLED_DATA / "tiny-critic"), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(critic)
    assert getattr(critic, "is_activation_checkpointing", None) or critic.is_gradient_checkpointing
