"""Tests for poise_trl.probe.features: spans, pooling, hooks, and one-pass multi-layer extraction."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import transformers
from torch import nn

from poise_trl.probe.capture import HiddenStateCapture, extract_features
from poise_trl.probe.features import (
    RolloutFeatures,
    build_rollout_features,
    decoder_layers,
    entropy_span_means,
    last_think_end,
    policy_span,
    pool_hidden,
    pooling_positions,
    resolve_layer_index,
    token_entropy,
)

THINK = 5  # token id standing in for `</think>`


pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()


def make_batch():
    """8 rollouts: left-padded prompts (some shorter than n=10), right-padded completions.

    Rows: 0 one `</think>`; 1 none; 2 two (last one counts); 3 empty completion; 4 `</think>`
    first; 5 none, full length; 6 a `</think>` id only in the padding; 7 `</think>` last.
    """
    g = torch.Generator().manual_seed(1)
    P, T = 12, 10
    prompt_len = [12, 3, 7, 12, 1, 9, 10, 11]
    completion_len = [10, 4, 10, 0, 7, 10, 2, 8]
    prompt_ids = torch.randint(6, 64, (8, P), generator=g)
    completion_ids = torch.randint(6, 64, (8, T), generator=g)
    prompt_mask = torch.zeros(8, P, dtype=torch.long)
    completion_mask = torch.zeros(8, T, dtype=torch.long)
    for b in range(8):
        prompt_mask[b, P - prompt_len[b] :] = 1
        completion_mask[b, : completion_len[b]] = 1
    prompt_ids[prompt_mask == 0] = 0
    completion_ids[completion_mask == 0] = 0
    for b, t in [(0, 6), (2, 2), (2, 8), (4, 0), (6, 5), (7, 7)]:
        completion_ids[b, t] = THINK
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def reference_pool(hidden, prompt_mask, completion_ids, completion_mask, n=10):
    """Python-loop pooling straight from docs/algorithms.md, "Features z", for comparison."""
    P, T = prompt_mask.shape[1], completion_ids.shape[1]
    prompts, responses = [], []
    for b in range(hidden.shape[0]):
        real = [p for p in range(P) if prompt_mask[b, p]][-n:]
        valid = [t for t in range(T) if completion_mask[b, t]]
        ends = [t for t in valid if completion_ids[b, t] == THINK]
        window = ([t for t in valid if t <= ends[-1]] if ends else valid)[-n:]
        zero = torch.zeros(hidden.shape[-1])
        prompts.append(hidden[b, real].float().mean(0) if real else zero)
        responses.append(hidden[b, [P + t for t in window]].float().mean(0) if window else zero)
    return torch.stack(prompts), torch.stack(responses)


# ---------------------------------------------------------------------------------------------
# Pure helpers on hand-computed tensors
# ---------------------------------------------------------------------------------------------

# P=4, T=6, n=3, `</think>` = 9. Row 0: one `</think>` at t=2, prompt of 2 real tokens (< n);
# row 1: no `</think>` (a 9 sits in the padding); row 2: two `</think>` (t=0 and t=3);
# row 3: empty completion.
HAND_PROMPT_MASK = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
HAND_COMPLETION_IDS = torch.tensor(
    [[1, 2, 9, 3, 4, 0], [1, 2, 3, 4, 0, 9], [9, 1, 2, 9, 3, 4], [0, 0, 0, 0, 0, 0]]
)
HAND_COMPLETION_MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]
)


def test_last_think_end_uses_last_valid_occurrence():
    got = last_think_end(HAND_COMPLETION_IDS, HAND_COMPLETION_MASK, 9)
    assert got.tolist() == [2, -1, 3, -1]


def test_pooling_by_hand():
    index = pooling_positions(HAND_PROMPT_MASK, HAND_COMPLETION_IDS, HAND_COMPLETION_MASK, 9, n_pool=3)
    # hidden[b, s] = (s, 100 + s): the pooled vector is (mean position, 100 + mean position).
    pos = torch.arange(10, dtype=torch.float32)
    hidden = torch.stack([pos, 100 + pos], dim=-1).expand(4, 10, 2).clone()
    hidden[:, 0] = float("nan")  # a pad position holding garbage must not leak into any mean
    prompt = pool_hidden(hidden, index[0], index[1])
    response = pool_hidden(hidden, index[2], index[3])
    # prompts: {2,3} (shorter than n), {1,2,3}, {3}, {1,2,3}
    assert prompt[:, 0].tolist() == [2.5, 2.0, 3.0, 2.0]
    assert prompt[:, 1].tolist() == [102.5, 102.0, 103.0, 102.0]
    # responses (completion t sits at position 4 + t): row 0 t={0,1,2} ending at `</think>`;
    # row 1 last 3 valid t={1,2,3}; row 2 t={1,2,3} ending at the LAST `</think>`; row 3 empty -> 0
    assert response[:, 0].tolist() == [5.0, 6.0, 6.0, 0.0]
    assert response[3].tolist() == [0.0, 0.0]


def test_entropy_span_means_by_hand():
    entropies = torch.arange(1, 7, dtype=torch.float32).expand(4, 6).clone()
    entropies[HAND_COMPLETION_MASK == 0] = float("nan")  # padding may hold anything
    got = entropy_span_means(entropies, HAND_COMPLETION_IDS, HAND_COMPLETION_MASK, 9)
    expected = torch.tensor(
        [
            [3.0, 1.5, 4.5],  # valid 1..5; reasoning t<2 -> {1,2}; answer t>2 -> {4,5}
            [2.5, 2.5, 0.0],  # no `</think>`: all reasoning, empty answer -> 0
            [3.5, 2.0, 5.5],  # reasoning t<3 -> {1,2,3}; answer t>3 -> {5,6}
            [0.0, 0.0, 0.0],  # empty completion
        ]
    )
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_build_rollout_features_and_container():
    prompt, response = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3)
    entropies = torch.ones(4, 6)
    feats = build_rollout_features(prompt, response, entropies, HAND_COMPLETION_IDS, HAND_COMPLETION_MASK, 9)
    assert feats.prompt.dtype == torch.float32 and feats.entropy.shape == (4, 3)
    assert feats.entropy[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert len(feats) == 4 and feats.to_matrix().shape == (4, 9)
    both = RolloutFeatures.cat([feats, feats[torch.tensor([2, 0])]])
    assert len(both) == 6 and torch.equal(both.response[4], feats.response[2])
    assert torch.equal(feats[1:3].prompt, feats.prompt[1:3])
    with pytest.raises(ValueError, match="entropy"):
        RolloutFeatures(prompt, response, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="widths"):
        RolloutFeatures.cat([feats, RolloutFeatures(torch.zeros(1, 5), torch.zeros(1, 5), torch.zeros(1, 3))])


def test_resolve_layer_index():
    assert resolve_layer_index(36, 0.55) == 19  # reference: block 19 = hidden_states[20]
    assert resolve_layer_index(36, 0.5) == 17  # 18.0 exactly, not 18.000000001
    assert resolve_layer_index(36, 1.0) == 35
    assert resolve_layer_index(36, 0.01) == 0
    assert resolve_layer_index(10, 0.7) == 6  # 0.7 * 10 = 7.000000000000001 in floats
    assert resolve_layer_index(36, 0) == 0
    assert resolve_layer_index(36, -1) == 35
    assert resolve_layer_index(36, -36) == 0
    for bad in (36, -37, 0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"36 decoder layers.*\[-36, 35\].*\(0, 1\]"):
            resolve_layer_index(36, bad)
    for bad in (True, "19", None):
        with pytest.raises(TypeError):
            resolve_layer_index(36, bad)


# ---------------------------------------------------------------------------------------------
# With the tiny Qwen3 model
# ---------------------------------------------------------------------------------------------


def test_decoder_layers_through_wrappers(model):
    layers = model.model.layers
    assert decoder_layers(model) is layers
    assert decoder_layers(model.model) is layers
    assert decoder_layers(nn.DataParallel(model)) is layers
    torch.manual_seed(0)
    config = tiny_config()
    config.num_labels = 1
    token_cls = transformers.AutoModelForTokenClassification.from_config(config)
    assert decoder_layers(token_cls) is token_cls.model.layers
    with pytest.raises(ValueError, match="cannot find the decoder blocks of Linear"):
        decoder_layers(nn.Linear(2, 2))


def test_layer_features_match_hf_hidden_states(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch()
    feats = extract_features(model, prompt_ids, prompt_mask, completion_ids, completion_mask, THINK, [1], 8)
    with torch.no_grad():
        out = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
            output_hidden_states=True,
        )
    # block k's output is hidden_states[k + 1]
    prompt, response = reference_pool(out.hidden_states[2], prompt_mask, completion_ids, completion_mask)
    torch.testing.assert_close(feats[1].prompt, prompt, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats[1].response, response, rtol=0, atol=1e-6)
    assert torch.equal(feats[1].response[3], torch.zeros(32))  # empty completion
    assert torch.equal(feats[1].entropy[3], torch.zeros(3))


# A multi-turn completion as TRL's tool loop builds it: policy turn, tool result, policy turn (with a `</think>`),
# tool result; `tool_mask` 0 on the results (TRL's own mask of them in the loss). The last result stands at the
# end so that changing it can change nothing the policy's tokens see.
TURN_ONE, RESULT, TURN_TWO, LAST_RESULT = [7, 8, 9, 10], [40, 41, 42], [11, 12, THINK, 13, 14], [43, 44]
MULTI_TURN_TOOL_MASK = torch.tensor([[1] * 4 + [0] * 3 + [1] * 5 + [0] * 2])


def multi_turn_features(model, last_result: list[int], span: str | None, think: int = THINK) -> tuple:
    """The features of one multi-turn rollout read over `span` (None: every completion token), and the block-0
    output and completion-token entropies of the same sequence, by hand."""
    prompt_ids, prompt_mask = torch.tensor([[20, 21, 22]]), torch.ones(1, 3, dtype=torch.long)
    completion_ids = torch.tensor([TURN_ONE + RESULT + TURN_TWO + last_result])
    completion_mask = torch.ones_like(completion_ids)
    read = None if span is None else policy_span(completion_mask, MULTI_TURN_TOOL_MASK, span)
    (feats,) = extract_features(model, prompt_ids, prompt_mask, completion_ids, completion_mask, think, [0], 1,
                                n_pool=2, feature_mask=read).values()
    with torch.no_grad():
        out = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), output_hidden_states=True)
    probs = torch.softmax(out.logits[0, 2:-1].double(), dim=-1)
    return feats, out.hidden_states[1][0, 3:], -(probs * probs.log()).sum(-1)


def test_tool_results_are_masked_out_of_the_pooled_features_and_entropies_of_either_span(model):
    feats, hidden, entropy = multi_turn_features(model, LAST_RESULT, "last_turn")
    # last policy turn = completion positions 7..11: the last 2 tokens up to its `</think>` (8, 9); its entropies
    # split at the `</think>`: completion 7..11, reasoning 7..8, answer 10..11.
    torch.testing.assert_close(feats.response[0], hidden[[8, 9]].mean(0), rtol=0, atol=1e-6)
    expected = torch.stack([entropy[7:12].mean(), entropy[7:9].mean(), entropy[10:12].mean()]).float()
    torch.testing.assert_close(feats.entropy[0], expected, rtol=0, atol=1e-5)
    # all policy turns: the last 2 of each turn (2, 3 and 8, 9); entropies over both turns' 9 tokens
    feats, _, _ = multi_turn_features(model, LAST_RESULT, "all_turns")
    torch.testing.assert_close(feats.response[0], hidden[[2, 3, 8, 9]].mean(0), rtol=0, atol=1e-6)
    policy = [0, 1, 2, 3, 7, 8, 9, 10, 11]
    expected = torch.stack([entropy[policy].mean(), entropy[[0, 1, 2, 3, 7, 8]].mean(), entropy[10:12].mean()])
    torch.testing.assert_close(feats.entropy[0], expected.float(), rtol=0, atol=1e-5)
    # Another tool result after the policy's turns changes nothing read through the mask, with or without a
    # `</think>`; read without the mask, it changes the entropies after the last `</think>` and, without one, the
    # response vector, which then pools the result's tokens.
    for span, think in itertools.product(("last_turn", "all_turns"), (THINK, -1)):
        masked = [multi_turn_features(model, result, span, think)[0] for result in (LAST_RESULT, [50, 51])]
        assert torch.equal(masked[0].to_matrix(), masked[1].to_matrix())
    unmasked = [multi_turn_features(model, result, None)[0] for result in (LAST_RESULT, [50, 51])]
    assert not torch.isclose(unmasked[0].entropy[:, [0, 2]], unmasked[1].entropy[:, [0, 2]]).any()
    unmasked = [multi_turn_features(model, result, None, think=-1)[0] for result in (LAST_RESULT, [50, 51])]
    assert not torch.isclose(unmasked[0].response, unmasked[1].response).any()


def test_a_rollout_without_tool_results_reads_the_same_with_either_span():
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for span in ("last_turn", "all_turns"):
        assert torch.equal(policy_span(completion_mask, None, span), completion_mask.bool())
        assert torch.equal(policy_span(completion_mask, torch.ones_like(completion_mask), span),
                           completion_mask.bool())
    with pytest.raises(ValueError, match="feature span must be one of"):
        policy_span(completion_mask, None, "first_turn")


def test_entropy_matches_full_logits(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch()
    temperature = 0.7
    feats = extract_features(
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        THINK,
        [0],
        3,
        temperature=temperature,
    )
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        ).logits
    # completion token t is predicted by the logits at position P + t - 1
    probs = torch.softmax(logits[:, P - 1 : P + T - 1].double() / temperature, dim=-1)
    entropies = -(probs * probs.log()).sum(-1)
    expected = entropy_span_means(entropies, completion_ids, completion_mask, THINK)
    torch.testing.assert_close(feats[0].entropy, expected, rtol=0, atol=1e-5)
    assert (feats[0].entropy[:, 0] > 0).sum() == 7  # every non-empty completion


def test_token_entropy_in_chunks_equals_one_chunk(monkeypatch):
    logits = torch.randn(3, 5, 11) * 3
    whole = token_entropy(logits, 0.7)
    probs = torch.softmax(logits.double() / 0.7, dim=-1)
    torch.testing.assert_close(whole, (-(probs * probs.log()).sum(-1)).float(), rtol=0, atol=1e-5)
    monkeypatch.setattr("poise_trl.probe.features.ENTROPY_CHUNK_ELEMENTS", 4 * 11)  # 4 distributions a chunk
    assert torch.equal(token_entropy(logits, 0.7), whole)
    assert torch.equal(token_entropy(logits[:, -1], 0.7), whole[:, -1])  # (B, vocabulary) -> (B,)


def test_multi_layer_pass_equals_single_layer_passes_and_chunking(model):
    batch = make_batch()
    both = extract_features(model, *batch, THINK, [3, 0.5], batch_size=8)
    assert list(both) == [3, 1]  # 0.5 of 4 blocks -> block 1; keys in request order
    for layer in (1, 3):
        single = extract_features(model, *batch, THINK, layer, batch_size=8)[layer]
        assert torch.equal(both[layer].prompt, single.prompt)
        assert torch.equal(both[layer].response, single.response)
        assert torch.equal(both[layer].entropy, single.entropy)
        chunked = extract_features(model, *batch, THINK, layer, batch_size=3)[layer]
        for name in ("prompt", "response", "entropy"):
            torch.testing.assert_close(getattr(chunked, name), getattr(single, name), rtol=1e-5, atol=1e-5)


def test_restores_train_mode_and_handles_gradient_checkpointing(model):
    batch = make_batch()
    expected = extract_features(model, *batch, THINK, [2], batch_size=4)[2]
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable()
    ckpt.train()
    got = extract_features(ckpt, *batch, THINK, [2], batch_size=4)[2]
    assert ckpt.training and all(m.training for m in ckpt.modules())
    assert torch.equal(got.prompt, expected.prompt) and torch.equal(got.response, expected.response)


def test_hooks_removed_after_pass_and_after_exception():
    # A fresh model: transformers installs its own persistent hooks once output_hidden_states is used.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    batch = make_batch()
    layers = decoder_layers(model)
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    extract_features(model, *batch, THINK, [0, 1, 2, 3], batch_size=4)
    assert all(len(layer._forward_hooks) == 0 for layer in layers)

    def boom(module, args):
        raise RuntimeError("boom mid-forward")

    handle = layers[3].register_forward_pre_hook(boom)
    model.train()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            extract_features(model, *batch, THINK, [0, 1], batch_size=4)
    finally:
        handle.remove()
    assert model.training  # the mode was restored despite the exception
    assert all(len(layer._forward_hooks) == 0 for layer in layers)

    with pytest.raises(KeyError):
        with HiddenStateCapture(model, [0, 2]):
            assert len(layers[0]._forward_hooks) == 1
            raise KeyError("inside the with-block")
    assert all(len(layer._forward_hooks) == 0 for layer in layers)


def test_capture_is_gated(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    expected = extract_features(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, THINK, [1], 8
    )[1]
    with torch.no_grad(), HiddenStateCapture(model, [1]) as cap:
        cap.set_batch(prompt_mask, completion_ids, completion_mask, THINK)
        # inactive: a generate() call and a plain forward (e.g. a reference pass) are ignored
        model.generate(prompt_ids[:2], attention_mask=prompt_mask[:2], max_new_tokens=3, do_sample=False)
        model(input_ids=input_ids, attention_mask=attention_mask)
        with pytest.raises(RuntimeError, match="expected 8 rows"):
            cap.pop()
        cap.set_batch(prompt_mask, completion_ids, completion_mask, THINK)
        with cap.capturing():
            model(input_ids=input_ids[:5], attention_mask=attention_mask[:5])  # whole batch in two chunks
            model(input_ids=input_ids[5:], attention_mask=attention_mask[5:])
        model(input_ids=input_ids, attention_mask=attention_mask)  # inactive again
        prompt, response = cap.pop()[1]
    torch.testing.assert_close(prompt, expected.prompt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(response, expected.response, rtol=1e-5, atol=1e-5)


def test_peft_lora_features_equal_base_when_b_is_zero(model):
    import peft
    batch = make_batch()
    base = extract_features(model, *batch, THINK, [1, 3], batch_size=4)
    lora = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    assert decoder_layers(lora) is lora.get_base_model().model.layers
    wrapped = extract_features(lora, *batch, THINK, [1, 3], batch_size=4)
    for layer in (1, 3):
        for name in ("prompt", "response", "entropy"):
            torch.testing.assert_close(
                getattr(wrapped[layer], name), getattr(base[layer], name), rtol=0, atol=1e-6
            )
    # the hooks see the adapted activations: a non-zero B changes the features
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    moved = extract_features(lora, *batch, THINK, [3], batch_size=4)[3]
    assert not torch.allclose(moved.prompt, base[3].prompt, atol=1e-3)


def test_pooled_vectors_stay_small(model):
    """Only (B, d) tensors are kept by the capture, never (B, S, d)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = make_batch()
    with torch.no_grad(), HiddenStateCapture(model, [0, 1]) as cap:
        cap.set_batch(prompt_mask, completion_ids, completion_mask, THINK)
        with cap.capturing():
            model(
                input_ids=torch.cat([prompt_ids, completion_ids], 1),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1),
            )
        kept = [t for chunks in cap._pooled.values() for pair in chunks for t in pair]
        assert all(t.dim() == 2 and t.shape == (8, 32) and t.device.type == "cpu" for t in kept)
        assert all(t.dtype == torch.float32 for t in kept)
        assert not math.isnan(float(sum(t.sum() for t in kept)))
