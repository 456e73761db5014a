"""`poise probe-eval`: a thin Typer command over poise_trl.probe_eval (registered by cli/main.py)."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
_ROWS = {
    "probe": "POISE probe",
    "probe_no_entropy": "probe, no entropy",
    "probe_prompt_only": "probe, prompt only",
    "value_model": "value model",
    "constant": "constant (train mean)",
}


def probe_eval(
    model: str = typer.Option(
        None, "--model", "-m", help="Policy: a local folder or hub id (with a chat template). Required."
    ),
    dataset: str = typer.Option(
        None, "--dataset", "-d", help="Registered name (toy-arith, math-500, ...), a local json/jsonl/parquet/csv file or folder "
        "(save_to_disk too), or a hub id (math-500 and the other registered math sets come from the hub). Required."
    ),
    split: str = typer.Option(None, help="Split (default: a registered dataset's held-out split, toy-arith: test)."),
    question_column: str = typer.Option(None, "--question-column", help="Column of the questions, when not detected (dotted for nested fields; body+question joins two)."),
    answer_column: str = typer.Option(None, "--answer-column", help="Column of the gold answers, when not detected (dotted for nested fields, e.g. reward_model.ground_truth)."),
    limit: int = typer.Option(None, help="Use a random subset of this many prompts (seeded)."),
    prompt_suffix: str = typer.Option(None, "--prompt-suffix", help="Appended to every question."),
    system_prompt: str = typer.Option(None, "--system-prompt", help="System message before every question."),
    n_samples: int = typer.Option(8, "--n-samples", "-n", help="Rollouts per prompt (Avg@n)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature of the rollouts."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold of the rollouts."),
    max_new_tokens: int = typer.Option(
        None, "--max-new-tokens", help="Token budget per rollout (default: a `poise bench` benchmark's own, toy-arith 96; else 8192)."
    ),
    seed: int = typer.Option(0, help="Sampling seed (also the split's, unless --split-seed)."),
    split_seed: int = typer.Option(None, "--split-seed", help="Seed of the train / held-out prompt split."),
    heldout_fraction: float = typer.Option(0.3, "--heldout-fraction", help="Fraction of prompts held out for testing."),
    layer: str = typer.Option("0.55", help="Probe layer: block index (int) or depth fraction (float)."),
    layers: list[str] = typer.Option(
        None, "--layers", help="Layer sweep, e.g. --layers 0,1,2 or --layers 0.25 --layers 0.55 (default: all blocks up to 8, else 6 depths)."
    ),
    prompt_components: int = typer.Option(
        32, "--prompt-components", help="PCA dims of prompt vectors (at most one per 64 train prompts)."
    ),
    response_components: int = typer.Option(
        64, "--response-components", help="PCA dims of response vectors (at most one per 64 train rollouts)."
    ),
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
    value_batch_size: int = typer.Option(16, "--value-batch-size", help="Batch size of the value model's fine-tuning."),
    batch_size: int = typer.Option(64, "--batch-size", help="Rows per generation / feature batch."),
    output_dir: Path = typer.Option(Path("runs/probe-eval"), "--output-dir", "-o", help="Report, plots and the cache."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    engine: str = typer.Option(
        "auto", "--engine", help="What samples the rollouts: auto (vLLM when it imports and runs the model, GPU "
                                 "or CPU build; else transformers), vllm or transformers."
    ),
):
    """Can a probe on the policy's internal states predict the value of unseen prompts? (seed 000, Sec. 3.1)

    Samples and caches rollouts, fits the POISE probe on train prompts, and compares it on held-out prompts
    with a fine-tuned value model, ablated probes and a constant; writes report.json and plots.
    """
    # Imported here, not at the top: `poise --help` and the other commands should not load torch for us.
    from poise_trl import probe_eval as lib
    from poise_trl.cli.errors import fail, user_errors

    try:
        if not model or not dataset:
            raise lib.ProbeEvalError("give the policy with --model and the prompts with --dataset")
        from poise_trl.loading import check_model_files

        check_model_files(model)  # a truncated weights or tokenizer file: one line naming it, before sampling
        main_layer = lib.parse_layers([layer])
        if len(main_layer) != 1:
            raise lib.ProbeEvalError(f"--layer takes one block index or depth fraction, got {layer!r}")
        columns = {k: v for k, v in (("question", question_column), ("answer", answer_column)) if v}
        settings = lib.ProbeEvalSettings(
            model=model, dataset=dataset, split=split, columns=columns or None, limit=limit, prompt_suffix=prompt_suffix,
            system_prompt=system_prompt, n_samples=n_samples, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, seed=seed, split_seed=split_seed, heldout_fraction=heldout_fraction,
            layer=main_layer[0], layers=lib.parse_layers(layers) if layers else None,
            prompt_components=prompt_components, response_components=response_components, ridge_alpha=ridge_alpha,
            value_model=value_model, value_target=value_target, value_epochs=value_epochs, value_lr=value_lr,
            value_batch_size=value_batch_size, batch_size=batch_size, output_dir=str(output_dir), engine=engine,
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
    table = Table(title=title)
    for column in ("estimator", "MAE", "RMSE", escape("Pearson [95% CI]"), "Spearman", "Brier skill", "AUROC solved"):
        table.add_column(column, justify="left" if column == "estimator" else "right")
    for name, label in _ROWS.items():
        m = report["estimators"][name]["prompt_level"]
        ci = m["pearson_ci95"]
        table.add_row(label, _fmt(m["mae"]), _fmt(m["rmse"]), escape(f"{_fmt(m['pearson'])} [{_fmt(ci[0])}, {_fmt(ci[1])}]"),
                      _fmt(m["spearman"]), _fmt(m["brier_skill"]), _fmt(m["auroc_solved"]))
    console.print(table)

    sweep = Table(title=f"layer sweep: POISE probe per decoder block (of {report['model']['num_layers']})")
    for column in ("block", "depth", "Pearson", "MAE", "Spearman"):
        sweep.add_column(column, justify="right")
    for row in report["layer_sweep"]:
        m = row["metrics"]
        sweep.add_row(str(row["block"]), f"{row['depth']:.2f}", _fmt(m["pearson"]), _fmt(m["mae"]), _fmt(m["spearman"]))
    console.print(sweep)

    diff = report["probe_minus_value_model"]
    for metric in ("pearson", "mae"):
        ci = diff[metric]["ci95"] or [None, None]
        console.print(f"probe - value model, {metric}: {_fmt(diff[metric]['diff'])} "
                      f"(95% bootstrap CI over prompts [{_fmt(ci[0])}, {_fmt(ci[1])}])", markup=False, highlight=False)
    cache = report["cache"]
    console.print(
        f"rollouts {cache['rollouts']}, features computed for blocks {cache['feature_blocks_computed'] or 'none'}, "
        f"value model {cache['value_model']}; mean reward {data['mean_reward']:.3f}, "
        f"{report['timing']['total_seconds']:.1f} s", highlight=False)
    console.print(f"report: {output_dir / 'report.json'}; plots: {', '.join(report['plots'].values())}", highlight=False)
