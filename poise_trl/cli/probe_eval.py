"""`poise probe-eval`: a thin Typer command over poise_trl.evaluation.probe_eval (registered by cli/main.py)."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from poise_trl.cli.errors import console, fail, user_errors
from poise_trl.core.loading import check_model_files

_ROWS = {  # estimator -> its row's label, short so that the table fits 80 columns (the legend says what they are)
    "probe": "POISE probe",
    "probe_no_entropy": "no entropy",
    "probe_prompt_only": "prompt only",
    "value_model": "value model",
    "constant": "train mean",
}


def probe_eval(
    model: str = typer.Option(None, "--model", "-m", help="Policy: a local folder or hub id (with a chat template). "
                              "Required."),
    dataset: str = typer.Option(
        None, "--dataset", "-d", help="Registered name (toy-arith, math-500, ...), a local json/jsonl/parquet/csv "
        "file or folder (save_to_disk too), a hub id (math-500 and the other registered math sets come from the hub), "
        "a task (reasoning-gym:leg_counting), or a task mix: task names joined by + (equal weights, e.g. "
        "reasoning-gym:chain_sum+bfcl) or a YAML file with a recipe's `dataset:` list (names or {name, "
        "weight, seed, config}; weights share --limit). Tasks use their test rows. Required."
    ),
    split: str = typer.Option(None, help="Split (default: a registered dataset's held-out split, toy-arith: test; "
                             "a task's or mix's test rows)."),
    question_column: str = typer.Option(None, "--question-column", help="Column of the questions, when not detected "
                                        "(dotted for nested fields; body+question joins two)."),
    answer_column: str = typer.Option(None, "--answer-column", help="Column of the gold answers, when not detected "
                                      "(dotted for nested fields, e.g. reward_model.ground_truth)."),
    limit: int = typer.Option(None, help="Use a random subset of this many prompts (seeded); for a mix, the prompts "
                              "of all its tasks together."),
    prompt_suffix: str = typer.Option(None, "--prompt-suffix", help="Appended to every question."),
    system_prompt: str = typer.Option(None, "--system-prompt", help="System message before every question."),
    n_samples: int = typer.Option(8, "--n-samples", "-n", help="Rollouts per prompt (Avg@n)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature of the rollouts."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold of the rollouts."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Token budget per rollout (default: a `poise "
                                       "bench` benchmark's own, toy-arith 96; else 8192)."),
    seed: int = typer.Option(0, help="Sampling seed (also the split's, unless --split-seed)."),
    split_seed: int = typer.Option(None, "--split-seed", help="Seed of the train / held-out prompt split."),
    heldout_fraction: float = typer.Option(0.3, "--heldout-fraction", help="Share of prompts held out for testing."),
    layer: str = typer.Option("0.55", help="Probe layer: block index (int) or depth fraction (float)."),
    layers: list[str] = typer.Option(None, "--layers", help="Layer sweep, e.g. --layers 0,1,2 or --layers 0.25 "
                                     "--layers 0.55 (default: all blocks up to 8, else 6 depths)."),
    prompt_components: int = typer.Option(32, "--prompt-components", help="PCA dims of prompt vectors (at most one "
                                          "per 64 train prompts)."),
    response_components: int = typer.Option(64, "--response-components", help="PCA dims of response vectors (at "
                                            "most one per 64 train rollouts)."),
    ridge_alpha: float = typer.Option(100.0, "--ridge-alpha", help="Ridge penalty of the probe."),
    value_model: str = typer.Option(
        None, "--value-model", help="LM to fine-tune as the value model (default: a copy of --model; same tokenizer)."
    ),
    value_target: str = typer.Option(
        "reward", "--value-target", help="reward: the rollout's own reward; loo: leave-one-out, like the probe."
    ),
    value_epochs: int = typer.Option(3, "--value-epochs", help="Fine-tuning epochs of the value model."),
    value_lr: float = typer.Option(
        None, "--value-lr", help="Value model learning rate (default: 1e-3 below 10M parameters, else 1e-5)."
    ),
    value_batch_size: int = typer.Option(16, "--value-batch-size", help="Batch size of the value model's training."),
    batch_size: int = typer.Option(64, "--batch-size", help="Rows per generation / feature batch."),
    output_dir: Path = typer.Option(Path("runs/probe-eval"), "--output-dir", "-o", help="Report, plots, the cache."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    engine: str = typer.Option(
        "auto", "--engine", help="What samples the rollouts: auto (vLLM when it imports and runs the model, GPU "
                                 "or CPU build; else transformers), vllm or transformers."
    ),
    tools_from: Path = typer.Option(
        None, "--tools-from", help="A recipe whose tools or environment the model calls, within its limits: each "
        "rollout is a tool-calling conversation, its features read from the policy's own tokens (tool results "
        "masked). bfcl-multi brings its own tools."),
):
    """Can a probe on the policy's internal states predict the value of unseen prompts?

    The POISE paper's Sec. 3.1 experiment (docs/algorithms.md).

    Samples and caches rollouts, fits the POISE probe on train prompts, and compares it on held-out prompts
    with a fine-tuned value model, ablated probes and a constant; writes report.json and plots. On a task mix,
    also per task, and a transfer table: the probe fit on one task, scored on each other task.
    """
    from poise_trl.evaluation import probe_eval as lib
    from poise_trl.evaluation.agent import RecipeTools
    from poise_trl.run.recipe import recipe_tools

    try:
        if not model or not dataset:
            raise lib.ProbeEvalError("give the policy with --model and the prompts with --dataset")
        check_model_files(model)  # a truncated weights or tokenizer file: one line naming it, before sampling
        main_layer = lib.parse_layers([layer])
        if len(main_layer) != 1:
            raise lib.ProbeEvalError(f"--layer takes one block index or depth fraction, got {layer!r}")
        columns = {k: v for k, v in (("question", question_column), ("answer", answer_column)) if v}
        settings = lib.ProbeEvalSettings(
            model=model, dataset=dataset, split=split, columns=columns or None, limit=limit,
            prompt_suffix=prompt_suffix, system_prompt=system_prompt, n_samples=n_samples, temperature=temperature,
            top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, split_seed=split_seed, layer=main_layer[0],
            heldout_fraction=heldout_fraction, layers=lib.parse_layers(layers) if layers else None,
            prompt_components=prompt_components, response_components=response_components, ridge_alpha=ridge_alpha,
            value_model=value_model, value_target=value_target, value_epochs=value_epochs, value_lr=value_lr,
            value_batch_size=value_batch_size, batch_size=batch_size, output_dir=str(output_dir), engine=engine,
            tools=RecipeTools(**recipe_tools(tools_from)) if tools_from else None,
        )
        report = lib.run_probe_eval(settings, show_progress=not no_progress)
    except user_errors() as exc:
        fail(str(exc))
        return
    _print_report(report, output_dir)


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3f}"


def _print_report(report: dict, output_dir: Path) -> None:
    n, data = report["data"]["rollouts_per_prompt"], report["data"]
    title = (f"poise probe-eval: {data['heldout_prompts']} held-out prompts, predictions vs empirical Avg@{n} "
             f"(mean {data['heldout_mean_avg_at_n']:.3f})")
    solved = any(report["estimators"][name]["prompt_level"]["auroc_solved"] is not None for name in _ROWS)
    # 80 columns: no vertical rules, two-line headers, every cell on one line
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0, 0, 1), pad_edge=False)
    for column in ("estimator", "MAE", "Pearson", "95% CI", "Spearman", *(["AUROC\nsolved"] * solved),
                   "rollout\nAUROC", "Brier", "ECE"):
        table.add_column(column, justify="left" if column == "estimator" else "right", no_wrap=True)
    for name, label in _ROWS.items():
        m, right = report["estimators"][name]["prompt_level"], report["estimators"][name]["correctness"]
        low, high = (f"{x:.2f}" if x is not None else "n/a" for x in m["pearson_ci95"])
        table.add_row(label, _fmt(m["mae"]), _fmt(m["pearson"]), f"{low}-{high}", _fmt(m["spearman"]),
                      *([_fmt(m["auroc_solved"])] * solved), *(_fmt(right[k]) for k in ("auroc", "brier", "ece")))
    console.print(table)
    notes = ["no entropy / prompt only: the probe without its entropy features / on the prompt's features alone; "
             "train mean: every prompt predicted at the training prompts' mean.",
             "rollout AUROC, Brier, ECE: each held-out rollout's prediction read as the probability that it is right "
             "(reward above 1/2).",
             "n/a: the metric is undefined there (a constant prediction has no Pearson or Spearman)."]
    if not solved:
        notes.append("AUROC solved (prompts solved at least once vs never) is left out: every held-out prompt is "
                     "of one kind.")
    for note in notes:
        console.print(note, markup=False, highlight=False)

    sweep = Table(title=f"layer sweep: POISE probe per decoder block (of {report['model']['num_layers']})")
    for column in ("block", "depth", "Pearson", "MAE", "Spearman"):
        sweep.add_column(column, justify="right")
    for row in report["layer_sweep"]:
        m = row["metrics"]
        sweep.add_row(str(row["block"]), f"{row['depth']:.2f}", *(_fmt(m[k]) for k in ("pearson", "mae", "spearman")))
    console.print(sweep)

    if report.get("by_task"):
        _print_tasks(report)

    diff = report["probe_minus_value_model"]
    for metric in ("pearson", "mae", "auroc"):
        ci = diff[metric]["ci95"] or [None, None]
        console.print(f"probe - value model, {metric}: {_fmt(diff[metric]['diff'])} "
                      f"(95% bootstrap CI over prompts [{_fmt(ci[0])}, {_fmt(ci[1])}])", markup=False, highlight=False)
    cache = report["cache"]
    console.print(
        f"rollouts {cache['rollouts']}, features computed for blocks {cache['feature_blocks_computed'] or 'none'}, "
        f"value model {cache['value_model']}; mean reward {data['mean_reward']:.3f}, "
        f"{report['timing']['total_seconds']:.1f} s", highlight=False)
    plots = ", ".join(report["plots"].values())
    console.print(f"report: {output_dir / 'report.json'}; plots: {plots}", highlight=False)


_TASK_COLUMNS = {  # estimator -> column label of the per-task table
    "probe": "probe",
    "probe_task_only": "task-only probe",
    "value_model": "value model",
    "task_mean": "task mean",
}


def _print_tasks(report: dict) -> None:
    """The per-task table (Pearson / MAE of each estimator on the task's held-out prompts) and the transfer table."""
    n = report["data"]["rollouts_per_prompt"]
    table = Table(title=f"per task: Pearson / MAE vs Avg@{n} on each task's held-out prompts / rollout AUROC")
    for column in ("task", "train / held-out", f"Avg@{n}", *_TASK_COLUMNS.values()):
        table.add_column(column, justify="left" if column == "task" else "right")
    skipped = []
    for task, record in report["by_task"].items():
        sizes = f"{record['train_prompts']} / {record['heldout_prompts']}"
        if "skipped" in record:
            skipped.append(f"{task}: skipped, {record['skipped']}")
            table.add_row(escape(task), sizes, "", *["skipped"] * len(_TASK_COLUMNS))
            continue
        metrics = record["estimators"]
        table.add_row(escape(task), sizes, _fmt(record["heldout_mean_avg_at_n"]),
                      *(f"{_fmt(metrics[k]['pearson'])} / {_fmt(metrics[k]['mae'])} / "
                        f"{_fmt(metrics[k]['correctness']['auroc'])}" for k in _TASK_COLUMNS))
    console.print(table)
    for line in skipped:
        console.print(line, markup=False, highlight=False)

    transfer = report["transfer"]
    if not transfer["tasks"]:
        return
    table = Table(title="transfer: probe fit on the row's task, Pearson / MAE / rollout AUROC on the "
                        "column's held-out prompts")
    table.add_column("probe fit on")
    for task in transfer["tasks"]:
        table.add_column(escape(task), justify="right")
    matrices = (transfer["pearson"], transfer["mae"], transfer["auroc"])
    for task, *cells in zip(transfer["tasks"], *matrices, strict=True):
        table.add_row(escape(task), *(" / ".join(map(_fmt, cell)) for cell in zip(*cells, strict=True)))
    console.print(table)
