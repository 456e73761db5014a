"""Training-free process rewards: segmentation, V(prefix), placement, and that the
(B, T) advantages reach TRL's loss intact, for GRPO, RLOO, REINFORCE++ and POISE."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_parameters_moved, build_trainer, trainable_parameters
from transformers import AutoModelForCausalLM, AutoTokenizer

from poise_trl.algorithms import algorithms, get_algorithm
from poise_trl.algorithms.baselines import GRPOArmConfig
from poise_trl.algorithms.process_rewards import (
    ProcessRewardMixin,
    answer_logprob_means,
    episode_boundaries,
    process_rewards_from_values,
    thin_boundaries,
)
from poise_trl.seam.grpo import GRPOSeam

# ---------------------------------------------------------------------------------------
# Segmentation
# ---------------------------------------------------------------------------------------


def chars(text: str) -> list[str]:
    return list(text)  # the toy tokenizer: one token per character


def test_newline_boundaries_stop_at_think_end():
    pieces = ["<think>", "\n", "a", "\n", "b", "c", "\n", "</think>", "\n", "x", "\n"]
    # after each "\n" inside the thinking span: tokens 2, 4 and 7 (7 = right before </think>);
    # the newlines after </think> belong to the answer and make no boundary
    assert episode_boundaries(pieces, ["\n"], max_episode_tokens=100) == [2, 4, 7]
    # no </think>: the whole completion is thinking; a trailing "\n" makes no boundary at the end
    assert episode_boundaries(chars("ab\ncd\n"), ["\n"], 100) == [3]


def test_word_markers_start_an_episode_and_match_whole_words():
    pieces = ["I", " think", ".", " Wait", ",", " Some", " So", " x"]
    # " Wait" (token 3) and " So" (token 6) start episodes; "Some" is not "So"
    assert episode_boundaries(pieces, ["Wait", "So"], 100) == [3, 6]
    # the process-rewards post's markers with trailing punctuation/space work as literals
    assert episode_boundaries(pieces, ["Wait,", "So "], 100) == [3, 6]


def test_bpe_merged_separator_rounds_to_the_next_token():
    # ".\n\n" is one token: the boundary is after it; "\n\nThe" runs past the marker: after it too
    pieces = ["a", ".\n\n", "b", "\n\nThe", " c"]
    assert episode_boundaries(pieces, ["\n\n"], 100) == [2, 4]


def test_length_fallback_and_thinning():
    pieces = chars("abcdefghij\nklm")  # 14 tokens, one "\n" at 10 -> boundary 11
    # episodes [0, 11) and [11, 14): the first is cut every 4 tokens: 4, 8
    assert episode_boundaries(pieces, ["\n"], max_episode_tokens=4) == [4, 8, 11]
    assert episode_boundaries(chars("abcdefghij"), ["\n"], max_episode_tokens=4) == [4, 8]
    assert thin_boundaries([1, 2, 3], 5) == [1, 2, 3]
    # 10 boundaries to 3: evenly spaced, last kept: indices 2, 5, 9
    assert thin_boundaries(list(range(10, 20)), 3) == [12, 15, 19]


def test_process_rewards_land_on_episode_ends():
    # row 0: boundaries 2, 4; V = [-3, -2, -2.5] -> U = [1, -.5] on tokens 1 and 3
    # row 1: no boundary -> nothing
    rewards, mask = process_rewards_from_values([[-3.0, -2.0, -2.5], []], [[2, 4], []], width=6)
    assert torch.equal(rewards, torch.tensor([[0.0, 1.0, 0.0, -0.5, 0.0, 0.0], [0.0] * 6]))
    assert torch.equal(mask, torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 0.0], [0.0] * 6]))
    with pytest.raises(ValueError, match="values"):
        process_rewards_from_values([[0.0]], [[2]], width=4)


def test_config_mixin_validates():
    with pytest.raises(ValueError, match="process_reward_norm"):
        GRPOArmConfig(output_dir="x", process_reward_norm="token", use_cpu=True, report_to="none")
    cfg = GRPOArmConfig(output_dir="x", process_reward_markers="\n", use_cpu=True, report_to="none")
    assert cfg.process_reward_markers == ["\n"]


# ---------------------------------------------------------------------------------------
# V(prefix)
# ---------------------------------------------------------------------------------------


def test_answer_logprob_means_batched_equals_one_by_one(tiny_random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_random_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_random_model_dir)
    texts = [("What is 2 plus 3?", "5"), ("Add 17 and 4.\nso", "21"), ("x", "1234")]
    sequences, lengths = [], []
    for prefix, answer in texts:
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        sequences.append(tokenizer(prefix, add_special_tokens=False)["input_ids"] + answer_ids)
        lengths.append(len(answer_ids))
    batched = answer_logprob_means(model, sequences, lengths, tokenizer.pad_token_id, batch_size=8)
    for i, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        # token j is predicted by position j - 1: the answer's mean log-probability
        logps = logits.log_softmax(-1)[torch.arange(len(seq) - n - 1, len(seq) - 1), torch.tensor(seq[-n:])]
        torch.testing.assert_close(batched[i], logps.mean(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------
# Trainers: the (B, T) advantages reach `_compute_loss` unchanged
# ---------------------------------------------------------------------------------------


def test_process_rewards_are_a_switch_of_every_grpo_based_algorithm():
    for name, algorithm in algorithms().items():
        if issubclass(algorithm.trainer_class, GRPOSeam):
            assert issubclass(algorithm.trainer_class, ProcessRewardMixin), name
            assert {f.name: f.default for f in dataclasses.fields(algorithm.config_class)}["process_rewards"] is False
    with pytest.raises(ValueError, match="algo 'grpo_process' is gone: .* `algo: grpo` with `process_rewards: true`"):
        get_algorithm("grpo_process")


def interceptor(base):
    """`base` trainer recording each round's advantages and what `_compute_loss` receives."""

    class Intercepting(base):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.generated.append({k: output[k].clone() for k in ("completion_ids", "advantages")})
            return output

        def _compute_loss(self, model, inputs):
            self.seen.append({k: inputs[k].clone() for k in ("completion_ids", "advantages")})
            return super()._compute_loss(model, inputs)

    return Intercepting


# case -> (registered algo, overrides of its defaults); process_rewards is on in every case
CASES = {
    "grpo": ("grpo", {}),
    "rloo": ("rloo", {}),
    "reinforce_pp": ("reinforce_pp", {"beta": 0.01}),
    "poise": ("poise", {"probe_bootstrap_steps": 1, "probe_prompt_components": 2,
                                "probe_response_components": 2, "probe_buffer_rows": 32}),
}


def make_trainer(model_dir, out, case, **overrides):
    algo, case_overrides = CASES[case]
    algorithm = get_algorithm(algo)
    assert issubclass(algorithm.trainer_class, ProcessRewardMixin)
    recipe = {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 4,
        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 12,
        "max_steps": 1, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0,
        "process_rewards": True, "process_reward_markers": ["\n"], "process_reward_max_episode_tokens": 3,
        "process_reward_force_prompt": "</think>\n\\boxed{", **case_overrides, **overrides,
    }
    trainer = build_trainer(recipe, out, trainer_class=interceptor(algorithm.trainer_class))
    trainer.generated, trainer.seen = [], []
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_process_advantages_vary_within_rows_and_reach_the_loss_intact(tmp_path, tiny_random_model_dir, case):
    trainer = make_trainer(tiny_random_model_dir, tmp_path / case, case)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    generated, seen = trainer.generated[0], trainer.seen[0]
    adv, ids = generated["advantages"], generated["completion_ids"]
    assert adv.dim() == 2 and adv.shape == ids.shape
    # process-rewards post, check 1: advantages vary within a sequence
    mask = ids != trainer.processing_class.pad_token_id
    spread = torch.where(mask, adv, -torch.inf).amax(1) - torch.where(mask, adv, torch.inf).amin(1)
    assert (spread > 1e-6).any()
    # TRL shuffled the rows: find each row of the loss batch among the generated rows
    assert seen["advantages"].shape == adv.shape
    for row_ids, row_adv in zip(seen["completion_ids"], seen["advantages"], strict=True):
        matches = [i for i in range(len(ids)) if torch.equal(ids[i], row_ids) and torch.equal(adv[i], row_adv)]
        assert matches, "a row's (B, T) advantages changed between generation and the loss"
    logged = trainer.state.log_history[0]
    assert logged["process/frac_rows_varying"] > 0
    assert "process/adv_outcome_std" in logged and "process/adv_with_process_std" in logged
