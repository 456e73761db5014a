"""DAPO: the dynamic-sampling selection logic as pure functions, then the trainer on a 2-layer
random model (one process and two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_parameters_moved,
    assert_parameters_unchanged,
    build_trainer,
    digit_parity_reward,
    run_two_cpu_ranks,
    trainable_parameters,
)

from poise_trl.algorithms.dapo import (
    DAPO_STATE_FILE,
    DAPOTrainer,
    merge_batches,
    needs_another_round,
    select_groups,
)
from poise_trl.core import estimators

# ---------------------------------------------------------------------------------------
# Selection logic
# ---------------------------------------------------------------------------------------


def test_the_filter_counts_correctness_not_the_shaped_reward():
    # 3 groups of 4 with DAPO's overlong penalty on some lengths (L_max 20, L_cache 10).
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    lengths = torch.tensor([5, 12, 5, 5, 15, 5, 5, 20, 5, 5, 5, 5])
    shaped = correct.float() + estimators.overlong_penalty(lengths, 20, 10)
    # shaped: [1, .8, 1, 1, -.5, 0, 0, -1, 1, 0, 0, 0]: every group has spread
    torch.testing.assert_close(shaped, torch.tensor([1, .8, 1, 1, -.5, 0, 0, -1, 1, 0, 0, 0]))
    # Eq. (11): 0 < #correct < 4 only for the third group (1 of 4 correct)
    assert estimators.dapo_keep_groups(correct, 4).tolist() == [False, False, True]


def test_select_groups_takes_the_first_kept_ones_and_never_repeats():
    assert select_groups([False, True, True, False, True], target=2) == ([1, 2], [True, True])
    # cap hit with 1 kept group of 3 wanted: the others fill the shape out of the loss ("drop"),
    # or in it ("zero_variance"); no group twice
    assert select_groups([False, True, False, False], target=3) == ([1, 0, 2], [True, False, False])
    assert select_groups([False, True, False, True], target=3) == ([1, 3, 0], [True, True, False])
    assert select_groups([False, True, False, False], target=3, fill="zero_variance") == ([1, 0, 2], [True] * 3)
    # nothing kept at all: nothing in the loss with "drop"
    assert select_groups([False, False, False], target=2) == ([0, 1], [False, False])
    with pytest.raises(ValueError, match="fill"):
        select_groups([True], 1, fill="repeat")


def test_select_groups_puts_only_kept_groups_in_the_loss():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        target = int(torch.randint(1, 6, (1,), generator=gen))
        rounds = int(torch.randint(1, 4, (1,), generator=gen))
        kept = (torch.rand(target * rounds, generator=gen) < 0.3).tolist()
        chosen, in_loss = select_groups(kept, target)
        assert len(chosen) == len(set(chosen)) == target
        assert sum(in_loss) == min(target, sum(kept))
        assert all(kept[g] for g, w in zip(chosen, in_loss, strict=True) if w)


def test_needs_another_round_until_every_process_has_its_target_or_the_cap():
    two_procs = torch.tensor([[True, False, True], [False, False, True]])  # 2 and 1 informative groups
    assert needs_another_round(two_procs, target=2, rounds_done=1, max_rounds=4)  # process 1 is short
    assert not needs_another_round(two_procs, target=1, rounds_done=1, max_rounds=4)
    assert not needs_another_round(two_procs, target=2, rounds_done=4, max_rounds=4)  # cap


def test_merge_batches_pads_prompts_left_and_completions_right():
    a = {
        "prompt_ids": torch.tensor([[9, 1, 2], [3, 4, 5]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[6, 9], [7, 8]]), "completion_mask": torch.tensor([[1, 0], [1, 1]]),
        "advantages": torch.tensor([0.5, -0.5]), "ratio": torch.tensor([[1.5], [2.5]]),
        "ref_per_token_logps": torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), "num_items_in_batch": torch.tensor(3),
        "tags": ["a0", "a1"], "absent": None,
    }
    b = {
        "prompt_ids": torch.tensor([[1, 2], [3, 4]]), "prompt_mask": torch.tensor([[1, 1], [1, 1]]),
        "completion_ids": torch.tensor([[5, 6, 7], [8, 9, 9]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "advantages": torch.tensor([1.0, -1.0]), "ratio": torch.tensor([[3.5], [4.5]]),
        "ref_per_token_logps": torch.tensor([[-5.0, -6.0, -7.0], [-8.0, -9.0, -9.0]]),
        "num_items_in_batch": torch.tensor(4),
        "tags": ["b0", "b1"], "absent": None,
    }
    merged = merge_batches([a, b], [(1, 0), (0, 1)], pad_token_id=9)
    assert merged["prompt_ids"].tolist() == [[9, 1, 2], [3, 4, 5]]  # b's 2-token prompt left-padded
    assert merged["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert merged["completion_ids"].tolist() == [[5, 6, 7], [7, 8, 9]]  # a's row right-padded
    assert merged["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert merged["ref_per_token_logps"].tolist() == [[-5.0, -6.0, -7.0], [-3.0, -4.0, 0.0]]
    assert merged["advantages"].tolist() == [1.0, -0.5]
    assert merged["ratio"].tolist() == [[3.5], [2.5]]
    assert merged["tags"] == ["b0", "a1"] and merged["absent"] is None
    assert "num_items_in_batch" not in merged  # the caller recomputes it


# ---------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def first_row_right(completions, **kwargs) -> list[float]:
    """Per round of 2 groups of 2: group 0 has 1 of 2 correct (kept), group 1 none (dropped)."""
    return [1.0] + [0.0] * (len(completions) - 1)


def make_trainer(model_dir, out, reward=digit_parity_reward, **overrides):
    recipe = {
        "algo": "dapo", "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 12, "max_steps": 2,
        "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0, "overlong_buffer_length": 0,
        **overrides,
    }

    class Recording(DAPOTrainer):
        merged: list = []
        extra_batches: list = []

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.merged.append(output)
            return output

        def _next_extra_batch(self, rows):
            batch = super()._next_extra_batch(rows)
            self.extra_batches.append([row["prompt"] for row in batch])
            return batch

    Recording.merged, Recording.extra_batches = [], []
    return build_trainer(recipe, out, reward_funcs=[reward], trainer_class=Recording)


@pytest.mark.slow
def test_trained_groups_are_informative_and_the_batch_is_consistent(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "run", max_generation_rounds=6)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert trainer.state.global_step == 2
    history = trainer.dynamic_sampling_history
    assert len(history) == 2 and len(trainer.merged) == 2
    for record, batch in zip(history, trainer.merged, strict=True):
        assert 1 <= record["rounds"] <= 6
        assert record["generated_rollouts"] == record["rounds"] * 4 >= record["trained_rollouts"] == 4
        assert record["zero_variance_trained"] == 0  # enough informative groups were found
        # every trained group has a non-zero GRPO advantage: its rewards differ
        assert (batch["advantages"].view(-1, 2).abs().sum(dim=1) > 0).all()
        assert batch["completion_ids"].shape == batch["completion_mask"].shape
        assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    assert any(r["rounds"] > 1 for r in history)  # some zero-variance groups were replaced
    logged = trainer.state.log_history[0]
    assert logged["dapo/generated_per_trained"] >= 1.0


@pytest.mark.slow
def test_stops_at_the_cap_when_no_group_is_informative(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "cap", reward=zero_reward, max_generation_rounds=3,
                           max_steps=1)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_unchanged(before, trainer)  # nothing in the loss
    (record,) = trainer.dynamic_sampling_history
    assert record["rounds"] == 3 and record["generated_groups"] == 6 and record["informative_groups"] == 0
    assert record["trained_groups"] == 0 and record["zero_weight_groups"] == 2 and record["dropped_groups"] == 6
    batch = trainer.merged[0]
    assert batch["completion_ids"].shape[0] == 4  # the batch shape TRL splits
    assert (batch["tool_mask"] == 0).all() and int(batch["num_items_in_batch"]) == 0


@pytest.mark.slow
def test_at_the_cap_only_kept_groups_are_in_the_loss(tmp_path, tiny_random_model_dir):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "drop", reward=first_row_right, max_generation_rounds=2,
                           max_steps=1)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    (record,) = trainer.dynamic_sampling_history
    # 2 rounds x (1 kept + 1 dropped group): target 2 reached, no group repeated
    assert record["informative_groups"] == 2 and record["trained_groups"] == 2 and record["zero_weight_groups"] == 0
    trainer = make_trainer(tiny_random_model_dir, tmp_path / "drop1", reward=first_row_right, max_generation_rounds=1,
                           max_steps=1)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    (record,) = trainer.dynamic_sampling_history
    assert record["trained_groups"] == 1 and record["zero_weight_groups"] == 1
    batch = trainer.merged[0]
    # the kept group's rows are in the loss, the dropped group's are not, and the token-level
    # normaliser counts the kept tokens only: the step of a batch of the kept group alone
    assert batch["tool_mask"][:2].bool().all() and not batch["tool_mask"][2:].any()
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"][:2].sum())
    assert batch["advantages"][2:].abs().sum() == 0


@pytest.mark.slow
def test_resume_continues_the_extra_prompt_stream(tmp_path, tiny_random_model_dir):
    # Zero rewards: every round is uninformative, so each step draws exactly 2 extra batches.
    settings = {"reward": zero_reward, "max_generation_rounds": 3, "save_strategy": "steps", "save_steps": 1}
    straight = make_trainer(tiny_random_model_dir, tmp_path / "straight", **settings)
    straight.train()
    assert straight.extra_batches_drawn == 4 and len(straight.extra_batches) == 4
    assert len({str(batch) for batch in straight.extra_batches}) == 4  # the stream moves on
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    assert json.loads((checkpoint / DAPO_STATE_FILE).read_text()) == {"extra_batches_drawn": 2}

    resumed = make_trainer(tiny_random_model_dir, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.extra_batches_drawn == 4
    # step 2 of the resumed run draws what step 2 of the uninterrupted run drew
    assert resumed.extra_batches == straight.extra_batches[2:]

    # a checkpoint without the stream position (not written by DAPOTrainer) cannot resume dynamic sampling
    (checkpoint / DAPO_STATE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=DAPO_STATE_FILE):
        again = make_trainer(tiny_random_model_dir, tmp_path / "again", **settings)
        again.train(resume_from_checkpoint=str(checkpoint))
    # without dynamic sampling the stream is unused: a warning, and it starts at 0
    plain = make_trainer(tiny_random_model_dir, tmp_path / "plain", **settings, dynamic_sampling=False)
    with pytest.warns(UserWarning, match=DAPO_STATE_FILE):
        plain.train(resume_from_checkpoint=str(checkpoint))
    assert plain.extra_batches_drawn == 0 and plain.extra_batches == []


TWO_RANKS = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from accelerate import PartialState
from helpers import assert_parameters_moved, trainable_parameters
from test_dapo import make_trainer
trainer = make_trainer({model!r}, {out!r} + "/run", max_generation_rounds=5, max_steps=1)
before = trainable_parameters(trainer)
trainer.train()
assert_parameters_moved(before, trainer)
rank = PartialState().process_index
with open({out!r} + f"/rank{{rank}}.json", "w") as f:
    json.dump(trainer.dynamic_sampling_history, f)
# Tear gloo down before exit: its threads otherwise can abort the process at interpreter shutdown.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_agree_on_the_number_of_rounds(tmp_path, tiny_random_model_dir):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(tests=str(Path(__file__).parent), model=str(tiny_random_model_dir),
                                       out=str(tmp_path)))
    run_two_cpu_ranks(script)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # global counts, computed independently on each rank
    assert rank0[0]["generated_groups"] == rank0[0]["rounds"] * 4  # 2 groups per rank per round
