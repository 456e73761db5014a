"""`poise probe-eval`: the POISE paper's preliminary experiment (Sec. 3.1, Figure 1) on your own model.

Can a linear probe on the policy's internal states predict the expected reward of unseen prompts, and how
does it compare with a fine-tuned value model? Rollouts are sampled, graded and cached, split by prompt,
and every estimator is scored on held-out prompts against their empirical Avg@n, with a layer sweep,
per-task scores and a transfer table. Protocol: docs/algorithms.md ("probe-eval").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import datasets
import safetensors.torch
import torch
from transformers import AutoConfig

from poise_trl.core.estimators import leave_one_out_targets
from poise_trl.core.loading import load_causal_lm, load_tokenizer
from poise_trl.core.metrics import auroc, correctness_metrics, paired_bootstrap, value_metrics
from poise_trl.core.progress import progress_bars
from poise_trl.core.provenance import package_versions, write_json, write_text
from poise_trl.engines.generation import (
    ENGINES,
    TINY_MODEL_PARAMETERS,
    TransformersEngine,
    VLLMEngine,
    close_vllm_engines,
    is_tiny_on_cpu,
    one_cpu_thread,
    render_prompts,
    start_engine,
)
from poise_trl.evaluation.agent import AgentEngine, RecipeTools, Toolbox, task_tools, tool_calls
from poise_trl.evaluation.bench import resolve_model
from poise_trl.evaluation.bench_data import BENCHMARKS, COLUMN_FLAG, data_fingerprint
from poise_trl.evaluation.plots import plot_layer_sweep, plot_predictions, plot_transfer
from poise_trl.evaluation.value_model import load_value_model, predict_value_model, train_value_model
from poise_trl.probe.capture import extract_features
from poise_trl.probe.estimator import LinearValueProbe
from poise_trl.probe.features import RolloutFeatures, pad_sequences, policy_span, resolve_layer_index
from poise_trl.tasks import is_task, load_prompt_dataset, mix_entry, resolve_dataset, row_verifiers, score_rows
from poise_trl.tasks.math_grader import answer_to_str
from poise_trl.tasks.prompts import DATASETS, held_out_split

# the POISE reference run's max response; names `poise bench` knows use their budget (toy-arith: 96).
DEFAULT_MAX_NEW_TOKENS = 8192
# Rows x tokens per feature forward pass: bounds the (rows, tokens, vocab) logits on long completions.
FEATURE_TOKENS_PER_BATCH = 16384
SWEEP_FRACTIONS = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0)
PROBE_VARIANTS = {  # which feature groups each probe sees (POISE paper, Sec. 5 ablates these inputs)
    "probe": ("prompt", "response", "entropy"),
    "probe_prompt_only": ("prompt",),
    "probe_no_entropy": ("prompt", "response"),
}
VALUE_TARGETS = ("reward", "loo")
# Prompts each side of a split needs: a probe's prompt PCA needs two prompts to vary, a Pearson two points.
MIN_SIDE_PROMPTS = 2


class ProbeEvalError(ValueError):
    """A probe-eval run the user must fix; the message says how."""


@dataclass
class ProbeEvalSettings:
    """Everything a run depends on; `max_new_tokens=None` and `split=None` pick per-dataset defaults."""

    model: str
    dataset: str | list  # see `resolve_dataset`; a list is a task mix (poise_trl.tasks.mix_rows)
    split: str | None = None
    columns: dict[str, str] | None = None  # {"question": ..., "answer": ...} when detection fails
    limit: int | None = None
    prompt_suffix: str | None = None
    system_prompt: str | None = None
    n_samples: int = 8
    temperature: float = 1.0  # the POISE reference run samples at temperature 1.0, top-p 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    seed: int = 0
    split_seed: int | None = None  # None: `seed`
    heldout_fraction: float = 0.3
    layer: int | float = 0.55
    layers: Sequence[int | float] | None = None  # the sweep; None: all blocks up to 8, else SWEEP_FRACTIONS
    prompt_components: int = 32
    response_components: int = 64
    ridge_alpha: float = 100.0
    value_model: str | None = None  # None: a copy of the policy checkpoint
    value_target: str = "reward"
    value_epochs: int = 3
    value_lr: float | None = None  # None: 1e-3 for a tiny model (< 10M parameters), else 1e-5
    value_batch_size: int = 16
    batch_size: int = 64
    output_dir: str = "runs/probe-eval"
    engine: str = "auto"  # what samples the rollouts: auto, vllm or transformers (generation.resolve_engine)
    tools: RecipeTools | None = None  # a recipe's tools or environment the rollouts call (evaluation/agent.py)


# ---------------------------------------------------------------------------------------------- data


def check_mix_size(source: str | list, limit: int | None) -> None:
    """Weights share the prompts `--limit` asks for; without it each task gives its own default count, so
    weights would be ignored without a word."""
    if isinstance(source, list) and limit is None and len({mix_entry(entry).weight for entry in source}) > 1:
        raise ProbeEvalError("--dataset: the mix's weights share the prompts of --limit; give --limit N")


# ------------------------------------------------------------------------------------- split & rows


def split_prompts(num_prompts: int, heldout_fraction: float, seed: int,
                  tasks: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """(train, held-out) prompt indices, sorted, from a seeded permutation; with `tasks`, per task."""
    tasks = list(tasks) if tasks is not None else [None] * num_prompts
    train, heldout = [], []
    for task in dict.fromkeys(tasks):
        indices = [i for i, t in enumerate(tasks) if t == task]
        cut = round(heldout_fraction * len(indices))
        perm = torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed)).tolist()
        heldout += [indices[j] for j in perm[:cut]]
        train += [indices[j] for j in perm[cut:]]
    if min(len(train), len(heldout)) < MIN_SIDE_PROMPTS:
        raise ProbeEvalError(
            f"{num_prompts} prompts with --heldout-fraction {heldout_fraction} leave {len(train)} train "
            f"and {len(heldout)} held-out prompts; both sides need at least {MIN_SIDE_PROMPTS} (use more prompts)"
        )
    return sorted(train), sorted(heldout)


def rollout_rows(prompts: Sequence[int], n: int) -> torch.Tensor:
    """Row indices of the prompts' rollouts: rows are prompt-major (prompt i owns rows i*n .. i*n+n-1)."""
    return (torch.tensor(list(prompts), dtype=torch.long)[:, None] * n + torch.arange(n)).flatten()


def per_prompt_mean(row_values: torch.Tensor, n: int) -> torch.Tensor:
    return row_values.double().view(-1, n).mean(1)


# ----------------------------------------------------------------------------------------- layers


def parse_layers(items: Sequence[str]) -> list[int | float]:
    """`["0,2", "0.55"]` -> [0, 2, 0.55]: ints are block indices, numbers with a dot depth fractions."""
    layers: list[int | float] = []
    for token in (t.strip() for item in items for t in str(item).split(",")):
        if not token:
            continue
        try:
            layers.append(float(token) if any(c in token for c in ".eE") else int(token))
        except ValueError:
            raise ProbeEvalError(f"--layers: {token!r} is neither a block index nor a depth fraction") from None
    return layers


def default_sweep(num_layers: int) -> list[int | float]:
    """Every block of a small model (<= 8 blocks), otherwise a handful of depths including 0.55."""
    return list(range(num_layers)) if num_layers <= 8 else list(SWEEP_FRACTIONS)


# -------------------------------------------------------------------------------------- the policy


class Policy:
    """The policy checkpoint, loaded on first use: a run served from the cache never loads weights."""

    def __init__(self, path: str, engine: str = "auto"):
        self.path = path
        self.engine = engine  # what should sample it (generation.resolve_engine)
        self.sampled_with: str | None = None  # what did, in this process

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.path)

    @cached_property
    def model(self):
        return load_causal_lm(self.path)

    @cached_property
    def think_end_id(self) -> int:
        """Id of `</think>`; -1 (never matches) for a model without one, so responses pool at the end."""
        token_id = self.tokenizer.convert_tokens_to_ids("</think>")
        return -1 if token_id is None or token_id == self.tokenizer.unk_token_id else int(token_id)


def num_decoder_layers(model_path: str) -> int:
    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ProbeEvalError(f"cannot load the config of model {model_path!r}: {exc.__class__.__name__}") from None
    return int(config.get_text_config().num_hidden_layers)


def model_fingerprint(model_path: str) -> str:
    """What identifies the weights: name, size and mtime of each file of a local folder (hashing GBs of
    weights would take longer than the analysis); a hub id is identified by its name."""
    path = Path(model_path)
    if not path.is_dir():
        return model_path
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def _hash(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------- rollouts


def sample_rollouts(policy: Policy, dataset, settings: dict, batch_size: int, progress=None,
                    tools: RecipeTools | None = None) -> list[dict]:
    """Sample and grade n rollouts per prompt: one record per prompt with its token ids and rollouts; with tools (a
    recipe's, or a task's own) each rollout is a conversation, its completion ids those of every message after the
    prompt and its `tool_mask` marking the tool results."""
    prompts, answers = dataset["prompt"], [answer_to_str(a) for a in dataset["answer"]]
    n = settings["n_samples"]
    task = progress.add_task("sampling", total=len(prompts) * n) if progress else None
    kwargs = dict(
        num_samples=n,
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        max_new_tokens=settings["max_new_tokens"],
        seed=settings["seed"],
        on_batch=(lambda batch: progress.advance(task, len(batch))) if progress else None,
    )
    llm = start_engine(policy.path, policy.engine)
    engine = VLLMEngine(llm) if llm is not None else TransformersEngine(policy.model, policy.tokenizer, batch_size)
    toolbox = Toolbox(policy.tokenizer, tools) if tools is not None or task_tools(dataset) else None
    if toolbox is not None:  # tool-calling conversations (evaluation/agent.py)
        engine = AgentEngine(engine, toolbox, dataset.to_list(), batch_size)
    samples = engine.sample(prompts, **kwargs)
    if toolbox is not None:
        toolbox.close()
    if engine.kind == "vllm":
        close_vllm_engines()  # the features and the value model come next: give its memory back
    policy.sampled_with = engine.kind
    tokenizer = policy.tokenizer
    prompt_ids = tokenizer(render_prompts(tokenizer, prompts, toolbox and toolbox.template_kwargs),
                           add_special_tokens=False)["input_ids"]
    task_rows = "task" in dataset.column_names  # a task or mix: each group records its task
    tasks, verifiers = row_verifiers(dataset)
    groups = [{"prompt_index": i, "answer": answers[i], "prompt_ids": prompt_ids[i], "rollouts": []}
              | ({"task": tasks[i]} if task_rows else {}) for i in range(len(prompts))]
    rewards = score_rows([s.messages or s.text for s in samples], [tasks[s.prompt_index] for s in samples],
                         [verifiers[s.prompt_index] for s in samples])
    for s, reward in zip(samples, rewards, strict=True):
        groups[s.prompt_index]["rollouts"].append({
            "reward": reward,
            "completion_ids": s.token_ids,
            "num_tokens": s.num_tokens,
            "truncated": s.truncated,
            "text": s.text,
            **({"messages": s.messages, "tool_mask": s.tool_mask} if s.messages is not None else {}),
        })
    return groups


def load_or_sample_rollouts(
    cache_dir: Path, policy: Policy, dataset, settings: dict, batch_size: int, progress=None,
    tools: RecipeTools | None = None,
) -> tuple[list[dict], bool]:
    """(groups, sampled_now) from `cache_dir/rollouts.jsonl`, sampling it first when absent."""
    path = cache_dir / "rollouts.jsonl"
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()], False
    groups = sample_rollouts(policy, dataset, settings, batch_size, progress, tools)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_json(cache_dir / "settings.json", settings)
    # write-then-rename: a killed run leaves no half cache
    write_text(path, "".join(json.dumps(g, ensure_ascii=False) + "\n" for g in groups))
    return groups, True


# ---------------------------------------------------------------------------------------- features


def _feature_chunks(lengths: list[int], max_rows: int) -> list[slice]:
    """Consecutive row ranges of at most `max_rows` rows and FEATURE_TOKENS_PER_BATCH padded tokens."""
    chunks, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        longest = max(longest, length)
        if i > start and (i - start >= max_rows or (i - start + 1) * longest > FEATURE_TOKENS_PER_BATCH):
            chunks.append(slice(start, i))
            start, longest = i, length
    return chunks + [slice(start, len(lengths))] if lengths else chunks


def compute_features(
    policy: Policy, groups: list[dict], layers: list[int], temperature: float, batch_size: int, progress=None
) -> dict[int, RolloutFeatures]:
    """Features of every rollout at every block in `layers`, at the sampling temperature; over the policy's own
    tokens where the rollouts are tool-calling conversations."""
    rows = [(g["prompt_ids"], r["completion_ids"], r.get("tool_mask")) for g in groups for r in g["rollouts"]]
    pad = policy.tokenizer.pad_token_id
    task = progress.add_task("features", total=len(rows)) if progress else None
    parts: dict[int, list[RolloutFeatures]] = {layer: [] for layer in layers}
    for chunk in _feature_chunks([len(p) + len(c) for p, c, _ in rows], batch_size):
        prompt_ids, prompt_mask = pad_sequences([p for p, _, _ in rows[chunk]], pad, left=True)
        completion_ids, completion_mask = pad_sequences([c for _, c, _ in rows[chunk]], pad, left=False)
        masks = [m for _, _, m in rows[chunk]]
        tool_mask = None
        if any(masks):  # the policy's own tokens, tool results masked, over POISE's default span
            tool_mask, _ = pad_sequences([m or [1] * len(c) for (_, c, _), m in zip(rows[chunk], masks, strict=True)],
                                         0, left=False)
        with one_cpu_thread(is_tiny_on_cpu(policy.model)):
            out = extract_features(policy.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   policy.think_end_id, layers, batch_size=len(prompt_ids), temperature=temperature,
                                   feature_mask=policy_span(completion_mask, tool_mask, "last_turn"))
        for layer in layers:
            parts[layer].append(out[layer])
        if progress:
            progress.advance(task, len(prompt_ids))
    return {layer: RolloutFeatures.cat(chunks) for layer, chunks in parts.items()}


def load_or_compute_features(
    cache_dir: Path, policy: Policy, groups: list[dict], layers: list[int], temperature: float, batch_size: int,
    progress=None,
) -> tuple[dict[int, RolloutFeatures], list[int]]:
    """({block: features}, blocks computed now): cached blocks are read, the rest share one pass."""
    path = {layer: cache_dir / f"features-block{layer}.safetensors" for layer in layers}
    missing = [layer for layer in layers if not path[layer].exists()]
    if missing:
        computed = compute_features(policy, groups, missing, temperature, batch_size, progress)
        for layer, f in computed.items():
            tmp = path[layer].with_suffix(".tmp")
            safetensors.torch.save_file({"prompt": f.prompt, "response": f.response, "entropy": f.entropy},
                                        str(tmp), metadata={"block": str(layer), "n_pool": "10"})
            os.replace(tmp, path[layer])
    features = {}
    for layer in layers:
        t = safetensors.torch.load_file(str(path[layer]))
        features[layer] = RolloutFeatures(t["prompt"], t["response"], t["entropy"])
    return features, missing


# ------------------------------------------------------------------------------------------ probes


def probe_dims(requested_prompt: int, requested_response: int, train_prompts: int, train_rows: int) -> tuple[int, int]:
    """PCA dims, at most one per 64 independent samples (prompt PCA: prompts; response PCA: rows).

    The reference 32/64 are 1/64 of its 4096-row buffer; on toy-arith (140 train prompts, split seeds 1-8)
    32/64 gave held-out Pearson 0.61, the capped 2/17 0.73.
    """
    return min(requested_prompt, max(1, train_prompts // 64)), min(requested_response, max(1, train_rows // 64))


def probe_settings(settings: ProbeEvalSettings, train_prompts: int, n: int) -> dict:
    """LinearValueProbe arguments for a probe fit on `train_prompts` prompts' n rollouts each."""
    kp, kr = probe_dims(settings.prompt_components, settings.response_components, train_prompts, train_prompts * n)
    return {"prompt_components": kp, "response_components": kr, "ridge_alpha": settings.ridge_alpha}


def select_features(features: RolloutFeatures, keep: Sequence[str]) -> RolloutFeatures:
    """Zero the feature groups not in `keep`: the probe drops constant columns, so a zeroed group is
    exactly a probe without it."""
    return RolloutFeatures(*(getattr(features, name) if name in keep else torch.zeros_like(getattr(features, name))
                             for name in ("prompt", "response", "entropy")))


def fit_and_predict(probe: LinearValueProbe, features: RolloutFeatures, targets: torch.Tensor,
                    train_rows: torch.Tensor, heldout_rows: torch.Tensor) -> torch.Tensor:
    """Fit on the train rows (leave-one-out targets), predict the held-out rows."""
    return probe.fit(features[train_rows], targets[train_rows]).predict(features[heldout_rows])


def value_model_predictions(
    cache_dir: Path, policy: Policy, groups: list[dict], targets: torch.Tensor, train_prompts: list[int],
    heldout_prompts: list[int], settings: ProbeEvalSettings, value_path: str, progress=None,
) -> tuple[torch.Tensor, dict]:
    """Held-out row predictions of the value model and its training record, cached by everything they
    depend on (the rollouts through `cache_dir`, the value model's files and settings, the split)."""
    n = settings.n_samples
    config = {"path": value_path, "fingerprint": model_fingerprint(value_path), "target": settings.value_target,
              "epochs": settings.value_epochs, "lr": settings.value_lr, "batch_size": settings.value_batch_size,
              "seed": settings.seed, "train_prompts": train_prompts, "heldout_prompts": heldout_prompts}
    path = cache_dir / f"value-model-{_hash(config)}.json"
    if path.exists():
        record = json.loads(path.read_text())
        return torch.tensor(record["predictions"]), {**record["info"], "cached": True}
    if value_path != policy.path:
        if load_tokenizer(value_path).get_vocab() != policy.tokenizer.get_vocab():
            raise ProbeEvalError(
                f"--value-model {value_path} has another tokenizer than the policy; it must read the same "
                "token ids (e.g. a smaller model of the same family)"
            )
    seqs = [g["prompt_ids"] + r["completion_ids"] for g in groups for r in g["rollouts"]]
    train_rows, heldout_rows = rollout_rows(train_prompts, n).tolist(), rollout_rows(heldout_prompts, n).tolist()
    started = time.time()
    torch.manual_seed(settings.seed)  # the new head's initialization
    model = load_value_model(value_path)
    # LLM critics are fine-tuned at 1e-6..1e-5; a sub-10M toy model barely moves at such rates (on
    # toy-arith, 1e-4 left the value model near the constant; its own SFT used 3e-3).
    lr = settings.value_lr or (1e-3 if model.num_parameters() < TINY_MODEL_PARAMETERS else 1e-5)
    pad_id = policy.tokenizer.pad_token_id
    with one_cpu_thread(is_tiny_on_cpu(model)):
        losses = train_value_model(model, [seqs[i] for i in train_rows], targets[train_rows], pad_id,
                                   settings.value_epochs, lr, settings.value_batch_size, settings.seed, progress)
        predictions = predict_value_model(model, [seqs[i] for i in heldout_rows], pad_id, settings.value_batch_size)
    info = {k: config[k] for k in ("path", "target", "epochs", "batch_size", "seed")} | {"lr": lr}
    info |= {"parameters": sum(p.numel() for p in model.parameters()), "epoch_train_mse": losses,
             "train_seconds": round(time.time() - started, 1)}
    write_json(path, {"config": config, "info": info, "predictions": predictions.tolist()})
    return predictions, {**info, "cached": False}


# --------------------------------------------------------------------------------------- evaluation


def evaluate_probe(features: RolloutFeatures, rewards: torch.Tensor, train_prompts: list[int],
                   heldout_prompts: list[int], n: int, probe_settings: dict) -> dict:
    """Prompt-level held-out metrics of one probe (the layer sweep)."""
    train_rows, heldout_rows = rollout_rows(train_prompts, n), rollout_rows(heldout_prompts, n)
    pred = fit_and_predict(LinearValueProbe(**probe_settings), features, leave_one_out_targets(rewards, n),
                           train_rows, heldout_rows)
    return value_metrics(per_prompt_mean(pred, n), per_prompt_mean(rewards[heldout_rows], n))


def evaluate_estimators(
    features: RolloutFeatures, rewards: torch.Tensor, value_predictions: torch.Tensor, train_prompts: list[int],
    heldout_prompts: list[int], n: int, probe_settings: dict,
) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """Every estimator on the held-out prompts: (metrics, per-rollout predictions, empirical Avg@n).

    `prompt_level`: a prompt's mean prediction vs its Avg@n; `rollout_level`: one rollout's prediction vs
    the leave-one-out target (POISE's baseline in training); `correctness`: predictions as P(right).
    """
    train_rows, heldout_rows = rollout_rows(train_prompts, n), rollout_rows(heldout_prompts, n)
    loo = leave_one_out_targets(rewards, n)
    rows = {"constant": torch.full((len(heldout_rows),), float(rewards[train_rows].mean()))}
    for name, keep in PROBE_VARIANTS.items():
        rows[name] = fit_and_predict(LinearValueProbe(**probe_settings), select_features(features, keep), loo,
                                     train_rows, heldout_rows)
    rows["value_model"] = value_predictions
    empirical = per_prompt_mean(rewards[heldout_rows], n)
    metrics = {name: {"prompt_level": value_metrics(per_prompt_mean(rows[name], n), empirical),
                      "rollout_level": value_metrics(rows[name], loo[heldout_rows]),
                      "correctness": correctness_metrics(rows[name], is_right(rewards[heldout_rows]))}
               for name in rows}
    return metrics, rows, empirical


def is_right(rewards: torch.Tensor) -> torch.Tensor:
    """A rollout is right when its reward is above 1/2 (graders give 0/1, some tasks partial credit)."""
    return rewards > 0.5


def auroc_difference(pred_a: torch.Tensor, pred_b: torch.Tensor, rewards: torch.Tensor, n: int,
                     n_boot: int = 1000, seed: int = 0) -> dict:
    """Per-rollout AUROC of a minus b against correctness, with a 95% interval from redrawing prompts (a
    prompt's n rollouts stay together: they share its difficulty)."""
    right = is_right(rewards)
    prompts = torch.randint(len(rewards) // n, (n_boot, len(rewards) // n),
                            generator=torch.Generator().manual_seed(seed))
    redraws = [rollout_rows(picks.tolist(), n) for picks in prompts]
    diffs = torch.tensor([auroc(pred_a[rows], right[rows]) - auroc(pred_b[rows], right[rows])
                          for rows in redraws], dtype=torch.float64)
    diffs = diffs[diffs.isfinite()]  # a redraw with one class only has no AUROC
    quantiles = torch.tensor([0.025, 0.975], dtype=torch.float64)
    interval = diffs.quantile(quantiles).tolist() if diffs.numel() else []
    return {"diff": auroc(pred_a, right) - auroc(pred_b, right), "ci95": interval}


def task_sides(prompt_tasks: Sequence[str], train_prompts: list[int],
               heldout_prompts: list[int]) -> dict[str, tuple[list[int], list[int]]]:
    """Each task's (train, held-out) prompts, tasks in sorted order."""
    return {task: ([p for p in train_prompts if prompt_tasks[p] == task],
                   [p for p in heldout_prompts if prompt_tasks[p] == task]) for task in sorted(set(prompt_tasks))}


def task_skip_reason(train_prompts: int, heldout_prompts: int) -> str | None:
    """Why a task of a mix gets no per-task analysis, or None when it can have one."""
    if train_prompts < MIN_SIDE_PROMPTS:
        return (f"{train_prompts} train prompt(s): its own probe needs at least {MIN_SIDE_PROMPTS} "
                "(raise --limit or the task's weight)")
    if heldout_prompts < MIN_SIDE_PROMPTS:
        return (f"{heldout_prompts} held-out prompt(s): its metrics need at least {MIN_SIDE_PROMPTS} "
                "(raise --limit, the task's weight or --heldout-fraction)")
    return None


def evaluate_transfer(features: RolloutFeatures, rewards: torch.Tensor, sides: dict[str, tuple[list[int], list[int]]],
                      n: int, settings: ProbeEvalSettings) -> dict[str, dict[str, dict]]:
    """{A: {B: prompt-level metrics}}: the probe fit on task A's train rollouts alone (PCA dims sized to
    them), scored on task B's held-out prompts; A == B is the within-task probe."""
    loo = leave_one_out_targets(rewards, n)
    table = {}
    for source, (train, _) in sides.items():
        rows = rollout_rows(train, n)
        probe = LinearValueProbe(**probe_settings(settings, len(train), n)).fit(features[rows], loo[rows])
        table[source] = {}
        for target, (_, heldout) in sides.items():
            rows = rollout_rows(heldout, n)
            predictions = probe.predict(features[rows])
            table[source][target] = value_metrics(per_prompt_mean(predictions, n),
                                                  per_prompt_mean(rewards[rows], n))
            table[source][target]["correctness"] = correctness_metrics(predictions, is_right(rewards[rows]))
    return table


def evaluate_by_task(
    features: RolloutFeatures, rewards: torch.Tensor, prompt_tasks: Sequence[str], train_prompts: list[int],
    heldout_prompts: list[int], row_predictions: dict[str, torch.Tensor], empirical: torch.Tensor, n: int,
    settings: ProbeEvalSettings,
) -> tuple[dict, dict]:
    """(by_task, transfer): per task, the pooled estimators plus `task_mean` and `probe_task_only`."""
    by_task, analysable = {}, {}
    for task, (train, heldout) in task_sides(prompt_tasks, train_prompts, heldout_prompts).items():
        record = {"train_prompts": len(train), "heldout_prompts": len(heldout),
                  "mean_reward": float(rewards[rollout_rows(train + heldout, n)].mean())}
        by_task[task] = record
        reason = task_skip_reason(len(train), len(heldout))
        if reason:
            record["skipped"] = reason
            continue
        analysable[task] = (train, heldout)
        positions = [j for j, p in enumerate(heldout_prompts) if prompt_tasks[p] == task]
        target, task_rewards = empirical[positions], rewards[rollout_rows(heldout, n)]
        task_mean = torch.full((len(heldout) * n,), float(rewards[rollout_rows(train, n)].mean()))
        rows = {name: pred[rollout_rows(positions, n)] for name, pred in row_predictions.items()} | {
            "task_mean": task_mean}
        record["heldout_mean_avg_at_n"] = float(target.mean())
        record["estimators"] = {name: value_metrics(per_prompt_mean(pred, n), target)
                                | {"correctness": correctness_metrics(pred, is_right(task_rewards))}
                                for name, pred in rows.items()}
        record["probe_minus_value_model"] = {"auroc": auroc_difference(rows["probe"], rows["value_model"],
                                                                       task_rewards, n, seed=settings.seed)}
    table = evaluate_transfer(features, rewards, analysable, n, settings)
    for task in analysable:
        by_task[task]["estimators"]["probe_task_only"] = table[task][task]
    tasks = list(analysable)
    transfer = {
        "tasks": tasks,
        "pearson": [[table[a][b]["pearson"] for b in tasks] for a in tasks],
        "mae": [[table[a][b]["mae"] for b in tasks] for a in tasks],
        "auroc": [[table[a][b]["correctness"]["auroc"] for b in tasks] for a in tasks],
        "protocol": (f"Row A, column B: the probe fit on task A's train rollouts alone (leave-one-out "
                     f"targets), scored on task B's held-out prompts (mean of its {n} rollout predictions vs "
                     f"Avg@{n}; AUROC: each rollout's prediction vs whether it is right); the diagonal is "
                     "within-task. Tasks too small for their own probe are left out (by_task says why)."),
    }
    return by_task, transfer


# ---------------------------------------------------------------------------------------- the run


def check_settings(s: ProbeEvalSettings) -> None:
    problems = []
    if s.n_samples < 2:
        problems.append("--n-samples must be >= 2 (leave-one-out targets need a sibling)")
    if s.temperature <= 0 or not 0 < s.top_p <= 1:
        problems.append("need --temperature > 0 (n rollouts must differ) and 0 < --top-p <= 1")
    if not 0 < s.heldout_fraction < 1:
        problems.append("--heldout-fraction must be in (0, 1)")
    if s.engine not in ENGINES:
        problems.append(f"--engine must be one of {', '.join(ENGINES)}")
    if s.value_target not in VALUE_TARGETS:
        problems.append(f"--value-target must be one of {', '.join(VALUE_TARGETS)}")
    if min(s.value_epochs, s.value_batch_size, s.batch_size, s.prompt_components, s.response_components) < 1:
        problems.append("epochs, batch sizes and PCA dims must be >= 1")
    too_small = (s.value_lr is not None and s.value_lr <= 0) or (s.max_new_tokens is not None and s.max_new_tokens < 1)
    if too_small or s.ridge_alpha <= 0:
        problems.append("--value-lr and --ridge-alpha must be > 0, --max-new-tokens >= 1")
    if problems:
        raise ProbeEvalError("; ".join(problems))


def _json_safe(value):
    """NaN/inf -> None, so report.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@contextmanager
def _quiet_datasets():
    """No `datasets` progress bars while loading: ours follow, and an error should stay one line."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def run_probe_eval(settings: ProbeEvalSettings, show_progress: bool = True) -> dict:
    """The whole experiment; writes `report.json` and the plots into `settings.output_dir`, returns the report."""
    started = time.time()
    check_settings(settings)
    s = settings
    model_path = resolve_model(s.model)
    num_layers = num_decoder_layers(model_path)
    # Resolve every layer before any sampling: a bad index fails in a second, not after an hour.
    main_block = resolve_layer_index(num_layers, s.layer)
    asked = s.layers or default_sweep(num_layers)
    sweep_blocks = list(dict.fromkeys(resolve_layer_index(num_layers, x) for x in asked))
    blocks = sorted({main_block, *sweep_blocks})

    # A registered dataset is evaluated on its held-out split (toy-arith: the 200 test problems), a task or
    # mix on its test rows (as `poise bench`): the rows a policy trained on the task has not seen.
    source = resolve_dataset(s.dataset)
    check_mix_size(source, s.limit)
    registered = isinstance(source, str) and source in DATASETS
    split = s.split or ("test" if is_task(source) else held_out_split(source) if registered else None)
    with _quiet_datasets():
        dataset = load_prompt_dataset(source, split=split, columns=s.columns, prompt_suffix=s.prompt_suffix,
                                      system_prompt=s.system_prompt, limit=s.limit, seed=s.seed,
                                      column_option=COLUMN_FLAG)
    n = s.n_samples
    tools = s.tools
    benchmark = BENCHMARKS.get(source) if isinstance(source, str) else None
    max_new_tokens = s.max_new_tokens or (benchmark.max_new_tokens if benchmark else DEFAULT_MAX_NEW_TOKENS)
    sampling = {"model": model_path, "model_fingerprint": model_fingerprint(model_path), "dataset": source,
                "split": split, "limit": s.limit, "data_fingerprint": data_fingerprint(dataset), "n_samples": n,
                "temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": max_new_tokens, "seed": s.seed,
                "tools": dataclasses.asdict(tools) if tools else None}
    output_dir = Path(s.output_dir)
    cache_dir = output_dir / "cache" / _hash(sampling)
    split_seed = s.seed if s.split_seed is None else s.split_seed
    prompt_tasks = list(dataset["task"]) if "task" in dataset.column_names else None
    train_prompts, heldout_prompts = split_prompts(len(dataset), s.heldout_fraction, split_seed, prompt_tasks)
    value_path = resolve_model(s.value_model) if s.value_model else model_path
    policy = Policy(model_path, s.engine)

    timing = {}
    with progress_bars("probe-eval", enabled=show_progress) as progress:
        t0 = time.time()
        groups, sampled = load_or_sample_rollouts(cache_dir, policy, dataset, sampling, s.batch_size, progress,
                                                  tools)
        timing["rollouts_seconds"] = round(time.time() - t0, 2)
        t0 = time.time()
        features, computed = load_or_compute_features(cache_dir, policy, groups, blocks, s.temperature,
                                                      s.batch_size, progress)
        timing["features_seconds"] = round(time.time() - t0, 2)
        policy.__dict__.pop("model", None)  # free the policy's weights before the value model is loaded
        rewards = torch.tensor([r["reward"] for g in groups for r in g["rollouts"]])
        t0 = time.time()
        value_targets = rewards if s.value_target == "reward" else leave_one_out_targets(rewards, n)
        value_pred, value_info = value_model_predictions(
            cache_dir, policy, groups, value_targets, train_prompts, heldout_prompts, s, value_path, progress)
        timing["value_model_seconds"] = round(time.time() - t0, 2)

    pooled_probe = probe_settings(s, len(train_prompts), n)
    with one_cpu_thread():
        estimators, row_predictions, empirical = evaluate_estimators(
            features[main_block], rewards, value_pred, train_prompts, heldout_prompts, n, pooled_probe)
        prompt_predictions = {name: per_prompt_mean(pred, n) for name, pred in row_predictions.items()}
        sweep = [{"block": block, "depth": (block + 1) / num_layers, "metrics": evaluate_probe(
                      features[block], rewards, train_prompts, heldout_prompts, n, pooled_probe)}
                 for block in sweep_blocks]
        comparison = paired_bootstrap(prompt_predictions["probe"], prompt_predictions["value_model"], empirical,
                                      seed=s.seed)
        comparison["auroc"] = auroc_difference(row_predictions["probe"], row_predictions["value_model"],
                                               rewards[rollout_rows(heldout_prompts, n)], n, seed=s.seed)
        by_task, transfer = evaluate_by_task(
            features[main_block], rewards, prompt_tasks, train_prompts, heldout_prompts, row_predictions,
            empirical, n, s) if prompt_tasks else (None, None)

    prompt_metrics = {name: e["prompt_level"] for name, e in estimators.items()}
    plots = {
        "predicted_vs_empirical": str(plot_predictions(
            output_dir / "predicted_vs_empirical.png", empirical,
            {k: prompt_predictions[k] for k in ("probe", "value_model")}, prompt_metrics, n)),
        "layer_sweep": str(plot_layer_sweep(
            output_dir / "layer_sweep.png", sweep,
            {k: prompt_metrics[k] for k in ("value_model", "constant")})),
    }
    if transfer and transfer["tasks"]:
        plots["transfer"] = str(plot_transfer(output_dir / "transfer.png", transfer, n))
    all_rollouts = [r for g in groups for r in g["rollouts"]]
    report = {
        "settings": asdict(s) | {"model_path": model_path, "dataset_source": source, "split": split,
                                 "max_new_tokens": max_new_tokens, "value_model": value_path},
        "model": {"num_layers": num_layers, "main_block": main_block, "sweep_blocks": sweep_blocks},
        "rollouts_generated_with": policy.sampled_with,  # None: read from the cache
        "cache": {"dir": str(cache_dir), "rollouts": "sampled" if sampled else "reused",
                  "feature_blocks_computed": computed, "value_model": "reused" if value_info["cached"] else "trained"},
        "data": {
            "num_prompts": len(groups), "rollouts_per_prompt": n, "train_prompts": len(train_prompts),
            "heldout_prompts": len(heldout_prompts), "mean_reward": float(rewards.mean()),
            "solved_at_least_once": float((per_prompt_mean(rewards, n) > 0).double().mean()),
            "heldout_mean_avg_at_n": float(empirical.mean()),
            "mean_completion_tokens": sum(r["num_tokens"] for r in all_rollouts) / len(all_rollouts),
            "mean_tool_calls": sum(tool_calls(r.get("messages")) for r in all_rollouts) / len(all_rollouts),
            "truncated_fraction": sum(r["truncated"] for r in all_rollouts) / len(all_rollouts),
        },
        "protocol": (f"Split by prompt{', within each task' if prompt_tasks else ''} ({len(train_prompts)} train / "
                     f"{len(heldout_prompts)} held out). Probes are fit on train rollouts with leave-one-out "
                     f"targets; the value model on train (prompt, response) -> {s.value_target}. Every estimator "
                     f"predicts each held-out rollout; prompt_level averages the {n} predictions of a prompt and "
                     f"compares with its empirical Avg@{n}; rollout_level compares single-rollout predictions with "
                     "the leave-one-out target."),
        "probe": {"block": main_block, **pooled_probe},
        "estimators": estimators,
        "probe_minus_value_model": comparison,
        "value_model": value_info,
        "layer_sweep": sweep,
        "by_task": by_task,  # None without a `task` column
        "transfer": transfer,
        "split": {"seed": split_seed, "train": train_prompts, "heldout": heldout_prompts},
        "plots": plots,
        "timing": timing | {"total_seconds": round(time.time() - started, 2)},
        "versions": package_versions(),
    }
    report = _json_safe(report)
    write_json(output_dir / "report.json", report)
    return report
