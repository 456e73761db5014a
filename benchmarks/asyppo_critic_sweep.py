"""How well can the toy critics learn? An offline sweep on rollouts of the fixed tiny policy.

Generates `--batches` rounds of `--prompts` x `--generations` rollouts from data/tiny-qwen3
(temperature 1, as the toy recipes; the actor, tokenizer and train rows as `build_run` gives
them to an asyppo run), once, then replays them to critics built as
AsyPPOTrainer builds them (`CriticEnsemble`, Monte-Carlo targets, group-level data division),
one round at a time, for each setting of the sweep. Per round it records the explained
variance of (a) the values before the round's fit (out of sample), (b) after the fit (seed
001's order; in sample for the rows a critic trained on) and (c) cross-fitted (each row's
value from the critic that did not train on it), over all completion tokens and on V(s_0).
The policy does not move, so this is VAPO's value-pretraining setting and the first rounds of
training. Writes benchmarks/results/asyppo_critic_sweep.json.

    OMP_NUM_THREADS=1 python benchmarks/asyppo_critic_sweep.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path

import torch

from poise_trl.algorithms.critics import CriticEnsemble
from poise_trl.core import estimators
from poise_trl.core.loading import resolve_model_path
from poise_trl.core.provenance import package_versions, write_json
from poise_trl.run.build import build_run
from poise_trl.run.recipe import parse_recipe
from poise_trl.tasks.rewards import math_accuracy_reward

REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def rollouts(actor, tokenizer, rows: list[dict], generations: int, max_new_tokens: int, seed: int) -> dict:
    """One round: prompt + completion ids as TRL lays them out (prompt left-, completion right-padded)."""
    prompts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
               for r in rows for _ in range(generations)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(seed)
    out = actor.generate(**enc.to(actor.device), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    completion = out[:, enc["input_ids"].size(1):].cpu()
    enc = enc.to("cpu")
    is_eos = completion == tokenizer.eos_token_id
    # mask up to and including the first EOS, as TRL's completion_mask
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], completion.size(1),
                                                                                      dtype=torch.long))
    mask = (torch.arange(completion.size(1)).unsqueeze(0) <= first_eos.unsqueeze(1)).long()
    texts = tokenizer.batch_decode(completion * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True)
    answers = [r["answer"] for r in rows for _ in range(generations)]
    rewards = torch.tensor(math_accuracy_reward([[{"role": "assistant", "content": t}] for t in texts], answers))
    return {"input_ids": torch.cat([enc["input_ids"], completion], 1),
            "attention_mask": torch.cat([enc["attention_mask"], mask], 1), "mask": mask, "rewards": rewards}


def replay(batches: list[dict], critic_model: str, generations: int, lr: float, epochs: int, num_critics: int,
           seed: int) -> list[dict]:
    critics = CriticEnsemble(critic_model, num_critics, learning_rate=lr, epochs=epochs, mini_batch_size=16, seed=seed)
    per_round = []
    for batch in batches:
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["mask"]
        width = mask.size(1)
        token_rewards = estimators.kl_penalized_token_rewards(batch["rewards"], torch.zeros(mask.shape), mask, 0.0)
        targets = estimators.returns_to_go(token_rewards, mask)
        assignment = estimators.critic_group_assignment(mask.size(0), generations, num_critics)
        prior = critics.values(ids, attn, width)
        critics.update(ids, attn, width, targets, mask, assignment)
        after = critics.values(ids, attn, width)
        candidates = {"prior": prior.mean(0), "after": after.mean(0)}
        if num_critics > 1:
            candidates["cross_fit"] = estimators.cross_fit_values(after, assignment)
        record = {}
        for name, value in candidates.items():
            record[f"ev_{name}"] = estimators.explained_variance(value, targets, mask)
            record[f"ev_{name}_first_token"] = estimators.explained_variance(value[:, :1], targets[:, :1], mask[:, :1])
        per_round.append(record)
    return per_round


def mean_second_half(per_round: list[dict]) -> dict:
    tail = per_round[len(per_round) // 2:]
    return {k: round(sum(r[k] for r in tail) / len(tail), 4) for k in tail[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--lrs", default="1e-4,1e-3")
    parser.add_argument("--epochs", default="1,4")
    parser.add_argument("--critics", default="data/tiny-critic,data/tiny-qwen3",
                        help="critic backbones: the 2-block tiny critic, the 4-block actor itself (fresh head)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "asyppo_critic_sweep.json"))
    cli = parser.parse_args()

    os.chdir(REPO)
    recipe = {"algo": "asyppo", "model": "data/tiny-qwen3", "dataset": "toy-arith", "seed": 0}
    with tempfile.TemporaryDirectory() as nothing_written:  # the run never trains
        built = build_run(parse_recipe(recipe, nothing_written))
    train_set, tokenizer, actor = built.train_set, built.tokenizer, built.trainer.model.float().eval()
    started = time.perf_counter()
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [rollouts(actor, tokenizer, [train_set[i] for i in order[b * cli.prompts:(b + 1) * cli.prompts]],
                        cli.generations, 96, seed=b) for b in range(cli.batches)]
    generation_seconds = time.perf_counter() - started
    rewards = torch.cat([b["rewards"] for b in batches])
    grouped = rewards.view(-1, cli.generations)
    # The best any prompt-level value can do: the share of reward variance between prompts.
    between = grouped.mean(1).var(unbiased=False) / rewards.var(unbiased=False)
    results = []
    for critic, lr, epochs in itertools.product(cli.critics.split(","), map(float, cli.lrs.split(",")),
                                                map(int, cli.epochs.split(","))):
        t0 = time.perf_counter()
        per_round = replay(batches, resolve_model_path(critic), cli.generations, lr, epochs, num_critics=2, seed=0)
        summary = mean_second_half(per_round)
        results.append({"critic_model": critic, "critic_learning_rate": lr, "critic_epochs": epochs,
                        "mean_second_half": summary, "seconds": round(time.perf_counter() - t0, 1),
                        "per_round": per_round})
        print(f"{critic:18s} lr {lr:.0e} epochs {epochs}: " + ", ".join(f"{k} {v:+.3f}" for k, v in summary.items()),
              flush=True)
    report = {"batches": cli.batches, "rows_per_batch": cli.prompts * cli.generations,
              "reward_mean": rewards.mean().item(),
              "between_prompt_variance_share": between.item(), "generation_seconds": round(generation_seconds, 1),
              "torch_threads": torch.get_num_threads(), "results": results, "versions": package_versions()}
    write_json(Path(cli.output), report)
    print(f"reward mean {rewards.mean():.3f}; between-prompt share of reward variance (in-sample, "
          f"{cli.generations} per prompt) {between:.3f}")


if __name__ == "__main__":
    main()
