"""Which policy turns POISE's probe should read in a multi-turn rollout (issue 52): the last policy turn or all
of them, tool results masked either way, and what happens without the mask.

The world: the bundled toy model (`data/tiny-qwen3`) taught, on training problems only, to answer a toy-arith
question in two turns with one tool, `add`: a call copying the operands from the question, then, after TRL's tool
loop has fed back the result, `\\boxed{<the result>}`. The taught model copies digits poorly (its calls rarely
carry the question's operands), so a rollout succeeds where its answer reports the tool's result
(`reports_tool_result`), and the questions are those of levels 1 and 2 (the 100 held-out questions with operands
of one or two digits; on longer results a copy almost never holds: 2% success over all levels in a trial run).
Its rollouts on the first `--questions` of them come from TRL's own tool loop
(`GRPOTrainer` with `tools=`, through the seam's `score_round`), `--samples` per question, for each `--seeds` (a
fresh sampling seed each). Each rollout's features are read three ways: `last_turn` and
`all_turns` (`probe.features.policy_span`, what POISE reads), and `unmasked` (every completion token, tool
result included: what POISE read before issue 52). For each of `--splits` seeded splits of the questions (half
train, half held out), a probe (POISE's `LinearValueProbe`, leave-one-out targets as in training) is fit on the
train questions' rollouts and scored on the held-out ones: AUROC of its per-rollout prediction against the
rollout being right, and Pearson of the per-question mean prediction against the question's success rate.
Reported per span: the mean over seeds x splits and a 95% percentile interval over those (seed, split) cells;
and the paired difference last_turn - all_turns with its interval over the same cells (splits of one seed share
the rollouts: the interval says how much the verdict depends on the split and the sampling seed).

    python benchmarks/probe_spans_multi_turn.py [--seeds 0 1] [--samples 4] [--questions 100] [--splits 20]
        [--sft-steps 200] [--model DIR] [--output benchmarks/results/probe_spans_multi_turn.json]

`--model DIR` keeps the taught model there (taught when DIR does not exist yet, reused when it does).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from poise_trl.core import estimators
from poise_trl.core.loading import resolve_model_path
from poise_trl.core.metrics import auroc, pearson
from poise_trl.core.provenance import package_versions, write_json
from poise_trl.probe.estimator import LinearValueProbe
from poise_trl.probe.features import (
    FEATURE_SPANS,
    RolloutFeatures,
    build_rollout_features,
    decoder_layers,
    policy_span,
    pool_hidden,
    pooling_positions,
    resolve_layer_index,
    token_entropy,
    turns,
)
from poise_trl.tasks import completion_text, load_prompt_dataset
from poise_trl.tasks.toy_task import generate_problems

READS = (*FEATURE_SPANS, "unmasked")
MAX_LEVEL = 2  # operands of 1 and 2 digits: the taught model's copies of 3- and 4-digit results almost never hold
LAYER, POOL = 0.55, 10  # the toy recipe's probe_layer (block 2 of 4) and POISE's default pooled tokens
PROBE = {"prompt_components": 2, "response_components": 8, "ridge_alpha": 10.0}  # small: 50 train questions x 4


def add(a: int, b: int) -> int:
    """Adds a and b.

    Args:
        a: An integer.
        b: An integer.
    """
    return a + b


def reports_tool_result(completions, **kwargs) -> list[float]:
    """1.0 where the final answer, `\\boxed{...}`, is the result the tool returned in the rollout."""
    rewards = []
    for messages in completions:
        results = [m["content"] for m in messages if m.get("role") == "tool"]
        answer = re.search(r"\\boxed\{([^}]*)\}", completion_text(messages))
        rewards.append(float(bool(results) and answer is not None and answer.group(1).strip() == results[-1]))
    return rewards


def conversation(tokenizer, question: str, a: int, b: int) -> tuple[str, list[tuple[int, int]]]:
    """The taught rollout as TRL's tool loop builds it (prompt, call turn, tool result, answer turn) and the
    character spans of the two policy turns."""
    user = [{"role": "user", "content": question}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}
    result = {"role": "tool", "name": "add", "content": str(a + b)}
    prompt = tokenizer.apply_chat_template(user, tools=[add], tokenize=False, add_generation_prompt=True)
    fed_back = tokenizer.apply_chat_template(user + [call, result], tools=[add], tokenize=False,
                                             add_generation_prompt=True)
    assert fed_back.startswith(prompt)
    turn_one_end = fed_back.index("<|im_end|>", len(prompt)) + len("<|im_end|>")
    text = fed_back + f"\\boxed{{{a + b}}}<|im_end|>"
    return text, [(len(prompt), turn_one_end), (len(fed_back), len(text))]


def teach(out: Path, steps: int, seed: int, batch: int = 8) -> None:
    """The bundled toy model taught the two-turn tool use on training problems (none of the held-out 200). The
    tool preamble of the system prompt is the same in every row: its keys and values are computed once per step
    without gradient and each row trains on what follows it (the user turn on)."""
    path = resolve_model_path("data/tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    held_out = {row["prompt"][0]["content"] for row in load_prompt_dataset("toy-arith", split="test")}
    prefix, rows = None, []
    for problem in generate_problems(batch * steps + 200, seed=seed + 1000):
        if problem["question"] in held_out:
            continue
        text, turns = conversation(tokenizer, problem["question"], problem["a"], problem["b"])
        cut = text.index("<|im_start|>user")
        prefix = text[:cut]
        encoded = tokenizer(text[cut:], add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(encoded["input_ids"])
        taught = [any(lo <= cut + start < hi for lo, hi in turns) for start, _ in encoded["offset_mapping"]]
        rows.append((ids, torch.where(torch.tensor(taught), ids, -100)))
    prefix_ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        chunk = rows[batch * step: batch * step + batch]
        ids = torch.nn.utils.rnn.pad_sequence([r[0] for r in chunk], batch_first=True,
                                              padding_value=tokenizer.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence([r[1] for r in chunk], batch_first=True, padding_value=-100)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r[0]) for r in chunk], batch_first=True)
        with torch.no_grad():
            cache = model(input_ids=prefix_ids, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(chunk))
        loss = model(input_ids=ids, attention_mask=torch.cat([torch.ones(len(chunk), prefix_ids.shape[1],
                                                                         dtype=mask.dtype), mask], 1),
                     past_key_values=cache, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0:
            print(f"teaching step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def read_features(model, out: dict, tool_mask: torch.Tensor | None) -> dict[str, RolloutFeatures]:
    """The rollouts' features read each way (READS) from one no-grad pass: the block's output and the token
    entropies, pooled as `HiddenStateCapture` pools them (`probe.features`)."""
    block = decoder_layers(model)[resolve_layer_index(len(decoder_layers(model)), LAYER)]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    width = out["completion_ids"].shape[1]
    seen = []
    handle = block.register_forward_hook(lambda module, args, output: seen.append(output[0] if isinstance(
        output, tuple) else output))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=width + 1).logits
    finally:
        handle.remove()
    entropies = token_entropy(logits[:, -width - 1: -1])
    features = {}
    for read in READS:
        span = out["completion_mask"] if read == "unmasked" else policy_span(out["completion_mask"], tool_mask, read)
        p_idx, p_ok, r_idx, r_ok = pooling_positions(out["prompt_mask"], out["completion_ids"], span, -1, POOL)
        features[read] = build_rollout_features(pool_hidden(seen[0], p_idx, p_ok), pool_hidden(seen[0], r_idx, r_ok),
                                                entropies, out["completion_ids"], span, -1)
    return features


def collect(model_dir: Path, seed: int, samples: int, questions: int, workdir: Path) -> dict:
    """`samples` rollouts of each held-out question through TRL's tool loop, and their features read each way."""
    from poise_trl.run.build import build_run
    from poise_trl.run.recipe import parse_recipe

    here = Path(__file__).stem
    recipe = {"algo": "grpo", "model": str(model_dir), "dataset": "toy-arith",
              "rewards": [f"{here}:reports_tool_result"], "tools": [f"{here}:add"], "max_tool_calling_iterations": 1,
              "num_generations": samples,
              "per_device_train_batch_size": 8 * samples, "max_completion_length": 160, "temperature": 1.0,
              "seed": seed, "save_strategy": "no", "eval_every": 0, "eval_limit": 1, "max_steps": 1}
    trainer = build_run(parse_recipe(recipe, str(workdir / f"seed{seed}")), overwrite=True).trainer
    trainer.model.train()
    rows = [row for row in load_prompt_dataset("toy-arith", split="test") if row["level"] <= MAX_LEVEL][:questions]
    features = {read: [] for read in READS}
    rewards, policy_turns = [], []
    torch.manual_seed(seed)
    for start in range(0, len(rows), 8):
        out = trainer.score_round([row for row in rows[start:start + 8] for _ in range(samples)])
        rewards.append(trainer.round.weighted_rewards.cpu())
        tool_mask = out.get("tool_mask")
        own = out["completion_mask"] if tool_mask is None else out["completion_mask"] * tool_mask
        policy_turns += turns(own.bool()).amax(1).tolist()
        for read, f in read_features(trainer.model, out, tool_mask).items():
            features[read].append(f)
    return {"rewards": torch.cat(rewards), "policy_turns": policy_turns,
            "features": {read: RolloutFeatures.cat(parts) for read, parts in features.items()}}


def scores(collected: dict, samples: int, splits: int) -> dict[str, list[dict]]:
    """Per read and split: held-out AUROC (rollouts) and Pearson (questions) of a probe fit on the other half."""
    rewards = collected["rewards"].float()
    questions = len(rewards) // samples
    targets = estimators.leave_one_out_targets(rewards, samples)
    out = {read: [] for read in READS}
    for split in range(splits):
        order = torch.randperm(questions, generator=torch.Generator().manual_seed(split))
        train, held = order[: questions // 2], order[questions // 2:]
        rows = lambda qs: (qs[:, None] * samples + torch.arange(samples)).flatten()  # noqa: E731
        for read, features in collected["features"].items():
            probe = LinearValueProbe(**PROBE).fit(features[rows(train)], targets[rows(train)])
            predicted = probe.predict(features[rows(held)])
            realized = rewards[rows(held)]
            by_question = predicted.view(-1, samples).mean(1), realized.view(-1, samples).mean(1)
            out[read].append({"auroc": auroc(predicted, realized > 0.5), "pearson": pearson(*by_question)})
    return out


def summary(values: list[float]) -> dict:
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return {"mean": round(float(values.mean()), 4),
            "interval_95": [round(float(np.percentile(values, 2.5)), 4), round(float(np.percentile(values, 97.5)), 4)],
            "cells": int(values.size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--samples", type=int, default=4, help="rollouts per held-out question")
    parser.add_argument("--questions", type=int, default=100, help="held-out questions (the first of levels 1-2)")
    parser.add_argument("--splits", type=int, default=20, help="seeded half/half splits of the questions")
    parser.add_argument("--sft-steps", type=int, default=200, help="steps teaching the tool use (8 rows each)")
    parser.add_argument("--model", default=None, help="a taught model folder to reuse (default: teach one)")
    parser.add_argument("--output", default="benchmarks/results/probe_spans_multi_turn.json")
    cli = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # the tool worker imports `add` from this file
    started = time.time()
    cells: dict[str, list[dict]] = {read: [] for read in READS}
    per_seed = {}
    with tempfile.TemporaryDirectory(prefix="probe_spans_") as workdir:
        model_dir = Path(cli.model or Path(workdir) / "tool-qwen3")
        if cli.model is None or not model_dir.exists():
            teach(model_dir, cli.sft_steps, seed=0)
        for seed in cli.seeds:
            collected = collect(model_dir, seed, cli.samples, cli.questions, Path(workdir))
            turns = torch.tensor(collected["policy_turns"], dtype=torch.float)
            per_seed[seed] = {"success_rate": round(collected["rewards"].float().mean().item(), 4),
                              "rollouts": len(turns), "mean_policy_turns": round(turns.mean().item(), 3),
                              "multi_turn_share": round((turns > 1).float().mean().item(), 4)}
            print(f"seed {seed}: {per_seed[seed]}", flush=True)
            for read, split_scores in scores(collected, cli.samples, cli.splits).items():
                cells[read] += split_scores
    result = {read: {metric: summary([c[metric] for c in cells[read]]) for metric in ("auroc", "pearson")}
              for read in READS}
    difference = {metric: summary([a[metric] - b[metric] for a, b in zip(cells["last_turn"], cells["all_turns"],
                                                                         strict=True)])
                  for metric in ("auroc", "pearson")}
    payload = {"command": "python benchmarks/probe_spans_multi_turn.py " + " ".join(sys.argv[1:]),
               "settings": {**vars(cli), "layer": LAYER, "pool_tokens": POOL, "probe": PROBE},
               "per_seed": per_seed, "spans": result, "last_turn_minus_all_turns": difference,
               "wall_seconds": round(time.time() - started, 1), "versions": package_versions()}
    write_json(Path(cli.output), payload)
    print(f"wrote {cli.output}: {result}\nlast_turn - all_turns: {difference}")


if __name__ == "__main__":
    main()
