"""POISE's features read while generating (features.GenerationCapture) equal the extra pass's.

The reference is `extract_features`: one full-sequence no-grad pass over the finished, TRL-padded
sequences (the pass the trainer no longer makes). Generation runs with the KV cache, so the two
differ by rounding only (the full pass gives RoPE pad-shifted positions, generate's cached attention
sums in another order): measured in float32 at <= 2.1e-6 (hidden states of magnitude <= 4) and
<= 5e-7 (entropies), about 5e-7 of the largest magnitude; asserted at atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import assert_parameters_moved, build_trainer, digit_parity_reward, trainable_parameters

from poise_trl.algorithms.poise import POISETrainer
from poise_trl.probe.capture import CaptureUnavailable, GenerationCapture, extract_features
from poise_trl.probe.features import decoder_layers, pad_sequences

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-5
PAD, EOS, THINK = 0, 1, 2  # token ids of the random models


def random_qwen3(seed: int = 0) -> transformers.Qwen3ForCausalLM:
    """The real Qwen3 architecture, small; an init 5x the default's so that entropies vary between tokens."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      initializer_range=0.1)
    return transformers.Qwen3ForCausalLM(config).eval()


class ForceTokens(transformers.LogitsProcessor):
    """Samples `forced[(row, step)]` at that step and never EOS / `</think>` elsewhere: shapes the
    completions (early EOS, `</think>` placement, truncation) without touching the model's logits,
    which the entropies are computed from."""

    def __init__(self, prompt_width: int, forced: dict[tuple[int, int], int], banned: tuple[int, ...]):
        self.prompt_width, self.forced, self.banned = prompt_width, forced, list(banned)

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_width
        scores = scores.clone()
        scores[:, self.banned] = -float("inf")
        for (row, at), token in self.forced.items():
            if at == step:
                scores[row] = -float("inf")
                scores[row, token] = 0.0
        return scores


def cut_after_eos(sequences: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Completion token lists up to and including the first EOS, as TRL keeps them."""
    out = []
    for row in sequences.tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


def captured_and_reference(model, prompts, *, eos, think, pad, layer=0.55, n_pool=10, temperature=1.0,
                           max_new_tokens=8, logits_processor=None, pad_to_multiple_of=None, mask_truncated=False,
                           **sampling):
    """Generate with the capture on, then run the full pass on the same rollouts (TRL's padding)."""
    prompt_ids, prompt_mask = pad_sequences(prompts, pad, left=True)
    torch.manual_seed(0)
    with torch.no_grad(), GenerationCapture(model, layer, [eos], think, temperature, n_pool) as capture:
        sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                                   temperature=temperature, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                   pad_token_id=pad, logits_processor=logits_processor, **sampling)
        completions = cut_after_eos(sequences[:, prompt_ids.shape[1]:], [eos])
        capture.finish(completions, pad)
    completion_ids, completion_mask = pad_sequences(completions, pad, left=False)
    if mask_truncated:  # TRL's mask_truncated_completions: rows without EOS are masked out entirely
        completion_mask[[c[-1] != eos for c in completions]] = 0
    if pad_to_multiple_of:  # TRL's pad_to_multiple_of: wider than what generate produced
        extra = -completion_ids.shape[1] % pad_to_multiple_of
        completion_ids = torch.nn.functional.pad(completion_ids, (0, extra), value=pad)
        completion_mask = torch.nn.functional.pad(completion_mask, (0, extra))
    captured = capture.features(completion_ids, completion_mask)
    (reference,) = extract_features(model, prompt_ids, prompt_mask, completion_ids, completion_mask, think, layer,
                                    batch_size=len(prompts), temperature=temperature, n_pool=n_pool).values()
    return captured, reference, completions


def assert_features_close(captured, reference):
    for name in ("prompt", "response", "entropy"):
        got, want = getattr(captured, name), getattr(reference, name)
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (name, (got - want).abs().max().item())


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


# Rows (8 new tokens at most): 0 `</think>` then EOS early; 1 EOS at once; 2 cut at max length before any
# `</think>`; 3 two `</think>` (the last counts), cut; 4 `</think>` as the very last token; 5 EOS as the last.
MIXED = {(0, 2): THINK, (0, 4): EOS, (1, 1): EOS, (3, 1): THINK, (3, 5): THINK, (4, 7): THINK, (5, 7): EOS}


@pytest.mark.parametrize("n_pool", [3, 10])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_random_qwen3_left_padding_early_eos_and_think_cuts(n_pool, temperature):
    model = random_qwen3()
    prompts = random_prompts([5, 12, 3, 9, 12, 7])  # left padding: prompts of different lengths
    force = ForceTokens(max(map(len, prompts)), MIXED, banned=(EOS, THINK))
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=PAD, n_pool=n_pool, temperature=temperature, top_k=20, top_p=0.9,
        logits_processor=[force], pad_to_multiple_of=5)
    assert [len(c) for c in completions] == [5, 2, 8, 8, 8, 8]
    assert THINK not in completions[2] and completions[4][-1] == THINK and completions[5][-1] == EOS
    assert_features_close(captured, reference)
    # The rows differ from each other: equality is not that of constants.
    assert captured.entropy[:, 0].std() > 0.01 and captured.response.std(0).mean() > 0.01


# What makes the host wait for the device: reading a value (.item, .tolist, .cpu, .numpy, int/float/bool of a
# tensor) and indexing with a boolean mask (its size depends on the values).
HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def test_the_capture_never_waits_for_the_device_inside_the_decode_loop(monkeypatch):
    """Every capture hook run inside generate's loop is counted for host synchronisations (CPU tensors
    here; the same code on a GPU would stall the pipeline once per decode step with each)."""
    in_hook, syncs = [False], []

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            if in_hook[0]:
                syncs.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    def indexing(name, original):
        def wrapper(self, index, *args):
            parts = index if isinstance(index, tuple) else (index,)
            if in_hook[0] and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                syncs.append(f"{name} with a boolean mask")
            return original(self, index, *args)
        return wrapper

    def flagged(original):
        def wrapper(self, *args, **kwargs):
            in_hook[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                in_hook[0] = False
        return wrapper

    for name in HOST_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, indexing(name, getattr(torch.Tensor, name)))
    hooks = ("_before_step", "_after_block", "_after_step")
    for name in hooks:
        monkeypatch.setattr(GenerationCapture, name, flagged(getattr(GenerationCapture, name)))
    monkeypatch.setattr(GenerationCapture, "_feed", counted("_feed", GenerationCapture._feed))  # not a sync: a count
    model = random_qwen3()
    prompts = random_prompts([5, 12, 3, 9, 12, 7])
    force = ForceTokens(max(map(len, prompts)), MIXED, banned=(EOS, THINK))
    captured, reference, completions = captured_and_reference(model, prompts, eos=EOS, think=THINK, pad=PAD,
                                                              logits_processor=[force])
    assert_features_close(captured, reference)
    assert syncs.count("_feed") == 7  # the hooks ran: one decode step per completion token but the last
    assert [name for name in syncs if name != "_feed"] == []


def test_every_row_ends_early_so_generate_stops_before_the_limit():
    model = random_qwen3(seed=1)
    prompts = random_prompts([4, 10, 7], seed=2)
    forced = {(0, 2): EOS, (1, 0): THINK, (1, 5): EOS, (2, 3): THINK, (2, 4): EOS}
    force = ForceTokens(max(map(len, prompts)), forced, banned=(EOS, THINK))
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=PAD, n_pool=4, max_new_tokens=12, logits_processor=[force])
    assert [len(c) for c in completions] == [3, 6, 5]  # the last EOS is never fed back by generate
    assert_features_close(captured, reference)


def test_prompts_of_one_length_where_generate_passes_no_mask():
    """transformers >= 5.24 gives the model no attention mask when no prompt is padded; the capture then counts
    every position, as a mask of ones would (the hook below makes this transformers behave so)."""
    model = random_qwen3(seed=6)

    def drop_a_mask_of_ones(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and bool(mask.all()):
            kwargs["attention_mask"] = None
        return args, kwargs

    model.register_forward_pre_hook(drop_a_mask_of_ones, with_kwargs=True)  # before the capture's hooks
    prompts = random_prompts([6, 6, 6], seed=7)  # one length: nothing to pad
    captured, reference, completions = captured_and_reference(model, prompts, eos=EOS, think=THINK, pad=PAD,
                                                              n_pool=3)
    assert all(len(c) == 8 for c in completions)  # every row ran to the limit: the closing step had no mask
    assert_features_close(captured, reference)


def test_padding_with_the_eos_token():
    """A tokenizer without a pad token pads with EOS (TRL then sets pad = EOS): a row that has finished
    goes on feeding EOS, which must not count as its end again."""
    model = random_qwen3(seed=4)
    prompts = random_prompts([5, 8, 3], seed=5)
    forced = {(0, 1): EOS, (1, 2): THINK, (1, 3): EOS}
    force = ForceTokens(max(map(len, prompts)), forced, banned=(EOS, THINK))
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=EOS, n_pool=3, logits_processor=[force])
    assert [len(c) for c in completions] == [2, 4, 8]
    assert_features_close(captured, reference)


def test_closing_step_with_a_cache_that_cannot_select_rows(monkeypatch):
    """A cache whose layers cannot keep a subset of rows: the closing step runs every row instead."""
    from transformers.cache_utils import DynamicLayer

    monkeypatch.delattr(DynamicLayer, "batch_select_indices")
    model = random_qwen3(seed=6)
    prompts = random_prompts([5, 8, 3], seed=7)
    force = ForceTokens(max(map(len, prompts)), {(0, 2): EOS, (1, 3): THINK}, banned=(EOS, THINK))
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=PAD, n_pool=3, logits_processor=[force])
    assert [len(c) for c in completions] == [3, 8, 8]  # row 0 finished before the closing step
    assert_features_close(captured, reference)


def test_closing_step_stops_after_the_probe_block():
    model = random_qwen3(seed=5)
    blocks = decoder_layers(model)
    assert len(blocks) == 2  # the probe reads block 1 of 2 at layer 0.55: nothing above it but the head
    calls = {"block": 0, "head": 0}
    blocks[1].register_forward_hook(lambda *_: calls.__setitem__("block", calls["block"] + 1))
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))
    prompt_ids, prompt_mask = pad_sequences(random_prompts([4, 6], seed=6), PAD, left=True)
    force = ForceTokens(6, {}, banned=(EOS, THINK))
    with torch.no_grad(), GenerationCapture(model, 0.55, [EOS], THINK) as capture:
        model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, max_new_tokens=5,
                       eos_token_id=EOS, pad_token_id=PAD, logits_processor=[force])
        assert calls == {"block": 5, "head": 5}
        capture.finish([[7] * 5, [7] * 5], PAD)
    assert calls == {"block": 6, "head": 5}  # the closing step ran the probe's block, not the head


def test_rows_trl_masks_out_as_truncated():
    model = random_qwen3(seed=3)
    prompts = random_prompts([5, 9, 2], seed=4)
    force = ForceTokens(9, {(0, 2): THINK, (0, 3): EOS, (1, 4): THINK}, banned=(EOS, THINK))
    captured, reference, _ = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=PAD, n_pool=3, logits_processor=[force], mask_truncated=True)
    assert_features_close(captured, reference)
    assert captured.response[1:].abs().sum() == 0 and captured.response[0].abs().sum() > 0


def test_lora_wrapped_model():
    from peft import LoraConfig, get_peft_model

    base = random_qwen3(seed=2)
    # init_lora_weights=False: B is random, so the adapter changes the hidden states.
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False)).eval()
    prompts = random_prompts([6, 11, 3, 8], seed=3)
    forced = {(0, 3): THINK, (0, 5): EOS, (2, 1): EOS}
    force = ForceTokens(max(map(len, prompts)), forced, banned=(EOS, THINK))
    captured, reference, _ = captured_and_reference(
        model, prompts, eos=EOS, think=THINK, pad=PAD, n_pool=3, logits_processor=[force])
    assert_features_close(captured, reference)
    with model.disable_adapter():
        prompt_ids, prompt_mask = pad_sequences(prompts, PAD, left=True)
        (without,) = extract_features(model, prompt_ids, prompt_mask, prompt_ids[:, :0], prompt_mask[:, :0], THINK,
                                      0.55, batch_size=4).values()
    assert not torch.allclose(without.prompt, captured.prompt, atol=1e-3)  # the capture saw the adapter


def test_bundled_tiny_qwen3_on_arithmetic_prompts(bundled_model_dir):
    from poise_trl.core.loading import load_causal_lm, load_tokenizer
    from poise_trl.tasks.toy_task import generate_problems

    tokenizer = load_tokenizer(str(bundled_model_dir))
    model = load_causal_lm(str(bundled_model_dir)).eval()
    think = tokenizer.convert_tokens_to_ids("</think>")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p["question"]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for p in generate_problems(6, seed=0)]
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=tokenizer.eos_token_id, think=think, pad=tokenizer.pad_token_id, n_pool=10,
        max_new_tokens=40)
    assert len({len(p) for p in prompts}) > 1
    ended = [c[-1] == tokenizer.eos_token_id for c in completions]
    assert any(ended) and not all(ended)  # rows that finished early and rows cut at the limit
    assert any(think not in c for c in completions) and any(think in c for c in completions)
    assert_features_close(captured, reference)


def test_capture_is_unusable_when_generate_does_not_feed_one_token_per_step():
    model = random_qwen3()
    prompt_ids, prompt_mask = pad_sequences(random_prompts([4, 6]), PAD, left=True)
    with torch.no_grad(), GenerationCapture(model, 0.55, [EOS], THINK) as capture:
        sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                                   max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD, use_cache=False)
        completions = cut_after_eos(sequences[:, prompt_ids.shape[1]:], [EOS])
        capture.finish(completions, PAD)
    completion_ids, completion_mask = pad_sequences(completions, PAD, left=False)
    with pytest.raises(CaptureUnavailable, match="one token per row per step"):
        capture.features(completion_ids, completion_mask)
    assert all(not block._forward_hooks for block in decoder_layers(model))
    assert not model._forward_hooks and not model._forward_pre_hooks


# ---------------------------------------------------------------------------------------------
# In the trainer
# ---------------------------------------------------------------------------------------------


class FeatureRecordingPOISE(POISETrainer):
    """Keeps the features each round handed to the probe."""

    def compute_advantages(self, rewards, output):
        self.recorded_features = self.round.features
        return super().compute_advantages(rewards, output)


def recipe(model_dir, **overrides):
    return {"algo": "poise", "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 32, "eval_limit": 2,
            "per_device_train_batch_size": 8, "max_completion_length": 12, "max_steps": 2, "logging_steps": 1,
            "save_steps": 100, "learning_rate": 1e-3, "seed": 0, "probe_bootstrap_steps": 1,
            "probe_prompt_components": 4, "probe_response_components": 4, "probe_buffer_rows": 64,
            "probe_pool_tokens": 4, **overrides}


def test_trainer_reads_features_from_trls_generate_call(tmp_path, bundled_model_dir):
    trainer = build_trainer(recipe(bundled_model_dir, max_completion_length=40), tmp_path / "run",
                            trainer_class=FeatureRecordingPOISE)
    assert trainer.generation_capture_blocker is None and not trainer.trl_runs_no_grad_pass()
    trainer.model.train()
    inputs = [trainer.train_dataset[i] for i in range(4) for _ in range(2)]
    output = trainer._generate_and_score_completions(inputs)
    assert trainer.feature_sources == {"trl_pass": 0, "generation": 1, "extra_pass": 0}
    assert trainer.policy_forward_passes == 0  # no pass of POISE's own
    reference, source = trainer.round_features(output)  # the pass it replaces, on the same rollouts
    assert source == "extra_pass"
    assert_features_close(trainer.recorded_features, reference)
    lengths = output["completion_mask"].sum(1)
    assert lengths.min() < 40 and lengths.max() == 40  # rows that finished early beside rows cut at the limit
    for block in decoder_layers(trainer.accelerator.unwrap_model(trainer.model)):
        assert not block._forward_hooks


def test_poise_makes_as_many_policy_passes_as_grpo(tmp_path, tiny_random_model_dir):
    """Transformers generation, num_iterations 1: neither runs a no-grad pass; POISE adds none."""
    trainers = {}
    for algo in ("poise", "grpo"):
        run = recipe(tiny_random_model_dir, algo=algo, num_generations=2)
        if algo == "grpo":
            run = {k: v for k, v in run.items() if not k.startswith("probe_")}
        trainer = trainers[algo] = build_trainer(run, tmp_path / algo, reward_funcs=[digit_parity_reward])
        before = trainable_parameters(trainer)
        trainer.train()
        assert_parameters_moved(before, trainer)
    # 2 steps x 1 training forward, nothing else.
    assert trainers["poise"].policy_forward_passes == trainers["grpo"].policy_forward_passes == 2
    poise = trainers["poise"]
    assert poise.feature_sources == {"trl_pass": 0, "generation": 2, "extra_pass": 0}
    logged = [e for e in poise.state.log_history if "probe/features_from_generation" in e]
    assert logged and all(e["probe/features_from_generation"] == 1.0 for e in logged)
    assert all(e["probe/features_from_extra_pass"] == 0.0 for e in logged)


def test_falls_back_to_the_extra_pass_when_generate_cannot_be_read(tmp_path, tiny_random_model_dir):
    run = recipe(tiny_random_model_dir, generation_kwargs={"use_cache": False})
    trainer = build_trainer(run, tmp_path / "run", reward_funcs=[digit_parity_reward])
    before = trainable_parameters(trainer)
    with pytest.warns(UserWarning, match="one token per row per step.*extra policy pass"):
        trainer.train()
    assert_parameters_moved(before, trainer)
    assert trainer.feature_sources == {"trl_pass": 0, "generation": 0, "extra_pass": 2}
    assert trainer.policy_forward_passes == 4  # 2 steps x (POISE's pass + the training forward)
    logged = [e for e in trainer.state.log_history if "probe/features_from_extra_pass" in e]
    assert logged and all(e["probe/features_from_extra_pass"] == 1.0 for e in logged)
