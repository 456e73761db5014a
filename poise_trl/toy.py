"""The tiny-model world: a character-level tokenizer with a chat template and a tiny Qwen3
causal LM taught (with TRL's SFTTrainer) to solve `toy-arith` with a scratchpad.

The model class is the real `Qwen3ForCausalLM`, so every code path (hooks on decoder
layers, fused entropies, PEFT, chat templates, `<think>` spans) is the one a Qwen3-4B run
takes. `build_tiny_model` is the reproducible project command behind `poise toy build`.
"""

from __future__ import annotations

import json
import random
import string
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from poise_trl import toy_task

# Qwen3's own chat format, reduced to what the toy needs; `{% generation %}` marks assistant
# text so TRL's assistant-only loss also works with this tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
# Not special: like Qwen3, the think markers survive `skip_special_tokens=True` decoding so
# rewards and span detection can see them.
THINK_TOKENS = ["<think>", "</think>", "\\boxed{"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus Qwen3's chat and think markers."""
    chars = list(string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", ""))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + THINK_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_model(tokenizer, seed: int, hidden_size: int = 128, num_layers: int = 4) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def sft_dataset(n: int, seed: int, slip_rate: float):
    """Prompt-completion pairs, so SFTTrainer trains on the assistant's answer only."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = toy_task.generate_problems(n, seed=seed)
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"]}],
                "completion": [
                    {"role": "assistant", "content": toy_task.assistant_response(r["a"], r["b"], slip_rate, rng)}
                ],
            }
            for r in rows
        ]
    )


def build_tiny_model(
    output_dir: str | Path,
    seed: int = 0,
    max_steps: int = 600,
    slip_rate: float = 0.15,
    hidden_size: int = 128,
    num_layers: int = 4,
    learning_rate: float = 3e-3,
    batch_size: int = 32,
    eval_samples: int = 4,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Build tokenizer + model, supervise on worked solutions, measure sampled accuracy on the
    held-out set, and save everything (safetensors) with a model card. Returns the card data.
    A model already in `output_dir` (the bundled one, by default) is kept unless `overwrite`."""
    from trl import SFTConfig, SFTTrainer

    from poise_trl.generation import TransformersEngine, evaluate_accuracy
    from poise_trl.prompts import load_prompt_dataset
    from poise_trl.provenance import package_versions

    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"{output_dir} is a file: give a folder with --output-dir")
    if not overwrite and any(output_dir.glob("*.safetensors")):
        raise ValueError(f"{output_dir} already holds a model: give --overwrite to replace it, or another --output-dir")
    scratch = tempfile.TemporaryDirectory(prefix="poise-toy-sft-")
    started = time.time()
    random.seed(seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, hidden_size=hidden_size, num_layers=num_layers)
    args = SFTConfig(
        output_dir=scratch.name,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, max_steps // 20),
        weight_decay=0.0,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=seed,
        data_seed=seed,
        max_length=256,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(max_steps * batch_size, seed=seed + 1, slip_rate=slip_rate),
        processing_class=tokenizer,
    )
    trainer.train()
    train_seconds = time.time() - started
    scratch.cleanup()

    model.eval()
    eval_set = load_prompt_dataset("toy-arith", split="test")
    accuracy = evaluate_accuracy(
        TransformersEngine(model, tokenizer, batch_size=128), eval_set, num_samples=eval_samples, temperature=1.0, max_new_tokens=96, seed=seed
    )
    card = {
        "name": "tiny-qwen3-toy-arith",
        "architecture": "Qwen3ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "sft": {
            "max_steps": max_steps,
            "batch_size": batch_size,
            "learning_rate": learning_rate,
            "slip_rate": slip_rate,
            "seed": seed,
        },
        "train_seconds": round(train_seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "heldout_sampled_accuracy": accuracy,
        "versions": package_versions(),
    }
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    (output_dir / "build_info.json").write_text(json.dumps(card, indent=2) + "\n")
    (output_dir / "README.md").write_text(_model_card(card))
    return card


def _model_card(card: dict) -> str:
    acc = card["heldout_sampled_accuracy"]
    levels = "\n".join(f"| {lvl} | {v:.3f} |" for lvl, v in sorted(acc["by_level"].items()))
    return f"""# tiny-qwen3-toy-arith

A {card['parameters']:,}-parameter `Qwen3ForCausalLM` ({card['num_layers']} layers, hidden size
{card['hidden_size']}) with a character-level tokenizer, a Qwen-style chat template and
`<think>`/`</think>` tokens. Taught with TRL's `SFTTrainer` to add integers in words
(`toy-arith`), writing a right-to-left column scratchpad inside `<think>...</think>` and the
answer in `\\boxed{{}}`. In {card['sft']['slip_rate']:.0%} of the columns of its training solutions
the sum is off by one (and the rest of the solution follows from the slip), so the model makes
careless slips when sampled, more often on longer sums: RL has room to help, and a value
probe has a difficulty signal to find.

Made by `poise toy build --output-dir <dir> --seed {card['sft']['seed']} --max-steps {card['sft']['max_steps']}`
in {card['train_seconds']} s of supervised training on a 2-core CPU with {card['torch_threads']} torch thread(s)
(SFT settings: {json.dumps(card['sft'])}).

Held-out sampled accuracy (temperature 1.0, {acc['num_samples']} samples on each of the
{acc['num_prompts']} problems of `data/toy-arith/eval.jsonl`): **{acc['accuracy']:.3f}**
(standard error {acc['stderr']:.3f}).

| level (digits per operand) | accuracy |
|---|---|
{levels}

Package versions: {json.dumps(card['versions'])}
"""
