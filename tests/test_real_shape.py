"""What Qwen3's real shape proves, on the reduced-depth real-shape world: Qwen3-0.6B's vocabulary (151,936)
and width (1024; 16 query / 8 KV heads of 128) with 2 decoder layers and random weights, and Qwen3's own
tokenizer and chat template (`poise toy build --world qwen3-shape --size 0.6b --layers 2`, built once per
session: about 15 s and 750 MB). Token ids are Qwen3's: nothing here holds for the toy tokenizer alone."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error
from safetensors.torch import load_file
from test_features_from_generation import ForceTokens, assert_features_close, captured_and_reference
from transformers import Qwen3ForCausalLM
from typer.testing import CliRunner

from poise_trl.algorithms.poise import POISEConfig
from poise_trl.cli.main import app
from poise_trl.core.loading import load_tokenizer
from poise_trl.engines.generation import render_prompts, vllm_import_error
from poise_trl.probe.capture import HiddenStateCapture
from poise_trl.probe.features import last_think_end, pad_sequences, pooling_positions, span_masks, token_entropy
from poise_trl.run.toy import QWEN3_TOKENIZER, build_real_shape_world, real_shape_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

THINK, THINK_END, IM_START, IM_END, PAD = 151667, 151668, 151644, 151645, 151643


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-shape-0.6b-2-layers")
    build_real_shape_world(path, size="0.6b", layers=2, seed=0)
    return path


@pytest.fixture(scope="module")
def tokenizer(world):
    return load_tokenizer(str(world))  # as training and evaluation load it


@pytest.fixture(scope="module")
def model(world):
    return Qwen3ForCausalLM.from_pretrained(world).eval()


def chat(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def test_the_world_has_qwen3s_shape_and_its_tokenizer_files_unchanged(world, tokenizer):
    config = json.loads((world / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (151936, 1024, 3072)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 8, 128)
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] and config["dtype"] == "float32"
    # The tokenizer.json the NOTICE names, byte for byte
    notice = (QWEN3_TOKENIZER / "NOTICE").read_text()
    assert hashlib.sha256((world / "tokenizer.json").read_bytes()).hexdigest() in notice
    assert len(tokenizer) == 151669 and tokenizer.padding_side == "left"
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<|im_start|>"]) == [THINK, THINK_END, IM_START]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (IM_END, PAD)
    card = json.loads((world / "build_info.json").read_text())
    assert card["parameters"] == 187_045_376 and card["real_num_hidden_layers"] == 28


def test_build_options_are_checked_in_one_line(tmp_path):
    def cli(*args):
        result = CliRunner().invoke(app, ["toy", "build", *args])
        return result, result.output

    assert_one_line_error(*cli("--world", "qwen3-shape", "--size", "7b", "-o", tmp_path), "unknown --size '7b'")
    assert_one_line_error(*cli("--world", "qwen3-shape", "--layers", "29", "-o", tmp_path), "1 to 28")
    assert_one_line_error(*cli("--layers", "2", "-o", tmp_path), "--world qwen3-shape")
    assert_one_line_error(*cli("--world", "qwen3-shape", "--max-steps", "5", "-o", tmp_path), "not trained")
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------- chat template


def test_chat_template_renders_system_and_user_turns_and_think(tokenizer):
    messages = chat("What is 2 + 2?", system="Answer briefly.")
    prompt = render_prompts(tokenizer, [messages])[0]  # how bench and probe-eval render prompts
    assert prompt == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    no_thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
    assert no_thinking == prompt + "<think>\n\n</think>\n\n"
    # A finished turn: the template splits the reasoning off at `</think>` and writes it back in its own format
    turn = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "<think>four</think>4"}],
                                         tokenize=False)
    assert turn.endswith("<|im_start|>assistant\n<think>\nfour\n</think>\n\n4<|im_end|>\n")
    ids = tokenizer(turn, add_special_tokens=False).input_ids
    assert (ids.count(IM_START), ids.count(IM_END), ids.count(THINK), ids.count(THINK_END)) == (3, 3, 1, 1)


def test_bfcls_prompts_are_qwen3s_own_tools_section(tokenizer):
    """BFCL's rows put the tools in a system message (tasks/bfcl.py): through the real template every prompt
    must read as Qwen3 renders `tools=` itself, non-ASCII descriptions (x², 12 of 1000) included."""
    bfcl = pytest.importorskip("poise_trl.tasks.bfcl")
    pytest.importorskip("bfcl_eval", reason="BFCL's data: pip install --no-deps bfcl-eval==2026.3.23")
    rows = [row for category in bfcl.CATEGORIES.values() for row in bfcl._category_rows(category)]
    differing = []
    for row in rows:
        tools = [{"type": "function", "function": bfcl._json_schema(f)} for f in row["verifier"]["functions"]]
        ours = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        native = tokenizer.apply_chat_template(row["prompt"][1:], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        if ours != native:
            differing.append(row["id"])
    assert len(rows) == 1000 and not differing, differing[:5]
    assert "<tools>\n{" in ours and ours.count("<|im_start|>") == 3


# ------------------------------------------------------------------------------------ spans and depth


def test_response_span_finds_think_end_and_im_end_by_their_real_ids(tokenizer):
    """The text `</think>` is one id wherever it stands; the same characters spelled by ordinary tokens
    ("</", "think", ">") decode to the same text but end no reasoning: spans go by id, never by text."""
    real = tokenizer("<think>\nplan</think>\n\nanswer", add_special_tokens=False).input_ids + [IM_END]
    spelled = [i for piece in ("<think>\nplan", "</", "think", ">\n\nanswer")
               for i in tokenizer(piece, add_special_tokens=False).input_ids] + [IM_END]
    assert tokenizer.decode(spelled) == tokenizer.decode(real) and real.count(THINK_END) == 1
    assert THINK_END not in spelled and len(spelled) > len(real)
    prompt_ids, prompt_mask = pad_sequences([[IM_START, 872], [IM_START]], PAD, left=True)
    ids, mask = pad_sequences([real, spelled], PAD, left=False)
    end = real.index(THINK_END)
    assert last_think_end(ids, mask, THINK_END).tolist() == [end, -1]
    completion, reasoning, answer = span_masks(ids, mask, THINK_END)
    assert reasoning[0].nonzero().max().item() == end - 1 and answer[0].nonzero().min().item() == end + 1
    assert ids[0, answer[0]].tolist()[-1] == IM_END  # the answer span runs to `<|im_end|>`
    assert torch.equal(reasoning[1], completion[1]) and not answer[1].any()
    _, _, response_index, response_valid = pooling_positions(prompt_mask, ids, mask, THINK_END, n_pool=3)
    last = torch.where(response_valid, response_index, -1).amax(1) - prompt_ids.shape[1]
    assert last.tolist() == [end, len(spelled) - 1]  # pooled up to `</think>`, else up to `<|im_end|>`


@pytest.mark.parametrize(("size", "fraction", "block"),
                         [("0.6b", 0.55, 15), ("1.7b", 0.55, 15), ("4b", 0.55, 19), ("0.6b", 0.5, 13),
                          ("0.6b", 1.0, 27), ("4b", 1.0, 35)])
def test_the_probe_layer_fraction_picks_the_block_at_that_depth(size, fraction, block):
    """Block ceil(f * L) - 1 of the model's own blocks, at the real depth (28 or 36; built on the meta device:
    shapes without memory)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(real_shape_config(size))
    capture = HiddenStateCapture(model, [fraction])
    assert capture.layers == [block] and capture.blocks is model.model.layers
    assert len(capture.blocks) == {"0.6b": 28, "1.7b": 28, "4b": 36}[size]
    assert POISEConfig.__dataclass_fields__["probe_layer"].default == 0.55


# ------------------------------------------------------------------------------------------ entropies


def test_entropies_over_the_real_vocabulary_equal_a_float64_reference(model, tokenizer):
    """The model's next-token distributions over 151,936 tokens (more rows than one entropy chunk holds),
    also at temperature 0.7 and sharpened (x 10: entropies from ~0.2 to ~12 nats). Float32 against float64:
    measured up to 1.4e-5 nats at ~12 (1.2e-6 relative), so atol and rtol 5e-6."""
    texts = render_prompts(tokenizer, [chat("What is 12 plus 30? Think first."), chat("Name three primes.")])
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == 151936 and logits[..., 0].numel() > (1 << 22) // 151936
    for scale, temperature in ((1.0, 1.0), (1.0, 0.7), (10.0, 1.0)):
        got = token_entropy(logits * scale, temperature).double()
        logp = torch.log_softmax(logits.double() * scale / temperature, dim=-1)
        reference = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(got, reference, atol=5e-6, rtol=5e-6), (scale, (got - reference).abs().max().item())
        if scale > 1:
            assert reference.min() < 1.0 and reference.max() > 5.0


# ---------------------------------------------------------------------------- features in generation


# Rows (8 new tokens at most): 0 `</think>` then `<|im_end|>` early; 1 `<|im_end|>` at once; 2 cut at max length
# before any `</think>`; 3 two `</think>` (the last counts), cut; 4 `</think>` as the very last token.
FORCED = {(0, 2): THINK_END, (0, 4): IM_END, (1, 1): IM_END, (3, 1): THINK_END, (3, 5): THINK_END, (4, 7): THINK_END}


def test_features_captured_in_generation_equal_the_full_pass(model, tokenizer):
    texts = render_prompts(tokenizer, [chat(q) for q in ("Hi.", "What is 12 plus 30? Show your work.", "2+2?",
                                                          "Spell cat backwards.", "A long question " * 6)])
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert len({len(p) for p in prompts}) > 3  # left padding differs between rows
    force = ForceTokens(max(map(len, prompts)), FORCED, banned=(IM_END, THINK_END))
    captured, reference, completions = captured_and_reference(
        model, prompts, eos=IM_END, think=THINK_END, pad=PAD, n_pool=4, logits_processor=[force])
    assert [len(c) for c in completions] == [5, 2, 8, 8, 8]
    assert completions[0][-1] == IM_END and THINK_END not in completions[2] and completions[4][-1] == THINK_END
    assert_features_close(captured, reference)
    assert captured.prompt.shape == (5, 1024) and captured.response.std(0).mean() > 0


# ------------------------------------------------------------------------------------- whole commands


def poise_cli(*args, timeout=900) -> subprocess.CompletedProcess:
    """A `poise` command in its own process, as a user runs it (TRL's colocated vLLM initialises
    torch.distributed, which a test process must not keep); tests/ on the path for the reward."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "POISE_DEBUG": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "poise_trl.cli.main", *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.vllm
@pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)")
def test_poise_steps_through_colocated_vllm_at_the_real_shape(world, tmp_path):
    """Two POISE steps with vLLM's CPU build colocated: the probe fits after the first and predicts in the
    second, the features ride TRL's importance-sampling pass, and every weight moves."""
    out = tmp_path / "poise"
    poise_cli("train", "recipes/toy/poise.yaml", f"model={world}", "rewards=[helpers:length_parity_reward]",
              "use_vllm=true", "vllm_mode=colocate", "per_device_train_batch_size=8", "max_completion_length=16",
              "max_steps=2", "probe_bootstrap_steps=1", "probe_prompt_components=2", "probe_response_components=2",
              "dataset_size=32", "eval_every=0", "eval_limit=4", "eval_num_samples=1", "eval_max_new_tokens=8",
              "save_strategy='no'", "logging_steps=1", "--output-dir", out, "--no-progress")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["generation"]["engine"] == "vllm"
    log = [entry for entry in summary["train_log"] if "probe/features_from_trl_pass" in entry]
    assert [entry["probe/features_from_trl_pass"] for entry in log] == [1.0, 1.0]
    assert log[-1]["probe/active_fraction"] == 1.0
    before, after = load_file(world / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    assert not [name for name in before if torch.equal(before[name], after[name])]


def test_bench_and_probe_eval_run_on_the_real_shape(world, tmp_path, monkeypatch):
    """Both with transformers generation (the colocated training test above starts vLLM at this shape); probe-eval
    grades by a hash of the text, since a random model is never right, so that every probe metric is defined."""
    from poise_trl.evaluation import probe_eval

    def coin(texts):
        return [float(zlib.crc32(text.encode()) % 2) for text in texts]

    monkeypatch.setattr(probe_eval, "score_rows", lambda texts, tasks, verifiers: coin(texts))
    questions = [f"What is {a} plus {a + 5}?" for a in range(20)]  # a held-out fifth of 4 prompts: Pearson defined
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "7"}) + "\n" for q in questions))

    def cli(*args):
        result = CliRunner().invoke(app, [str(a) for a in args] + ["--engine", "transformers", "--no-progress"])
        assert result.exit_code == 0, result.output
        name = "summary.json" if args[0] == "bench" else "report.json"
        return json.loads((tmp_path / args[-1] / name).read_text())

    summary = cli("bench", "toy-arith", "--model", world, "--data-file", data, "-n", 2, "--max-new-tokens", 8, "-o",
                  tmp_path / "bench")
    assert summary["engine"] == "transformers" and "toy-arith" in summary["benchmarks"]
    assert len((tmp_path / "bench" / "toy-arith" / "samples.jsonl").read_text().splitlines()) == 40
    report = cli("probe-eval", "--model", world, "--dataset", data, "-n", 2, "--max-new-tokens", 8,
                 "--value-epochs", 1, "--layers", "0,1", "-o", tmp_path / "probe")
    assert [row["block"] for row in report["layer_sweep"]] == [0, 1]
    assert all(isinstance(row["metrics"]["pearson"], float) for row in report["layer_sweep"])


def test_the_documented_real_shape_training_command_moves_every_weight_and_fits_the_probe(world, tmp_path):
    """docs/real-shapes.md's block as written (its `poise toy build` line left out: the session's world is linked
    in its place), run by bash with `poise` this interpreter's CLI."""
    repo = Path(__file__).resolve().parents[1]
    page = (repo / "docs" / "real-shapes.md").read_text().split("<!--real-shape-train-->", 1)[1]
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]
    block = "\n".join(line for line in block.splitlines() if not line.startswith("poise toy build"))
    (tmp_path / "qwen3-shape-0.6b-2-layers").symlink_to(world)
    (tmp_path / "recipes").symlink_to(repo / "recipes")
    script = f'poise() {{ "{sys.executable}" -m poise_trl.cli.main "$@"; }}\nset -e\n{block}'
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "runs" / "real_shape_poise"
    report = json.loads((out / "probe_report.json").read_text())
    assert report["rounds"] == 2 and report["probe_active_rounds"] == 1 and report["refit_count"] >= 1
    assert "note:" not in run.stdout  # neither the no-probe-baseline note nor the reward-0 one
    before, after = load_file(world / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    assert not [name for name in before if torch.equal(before[name], after[name])]
