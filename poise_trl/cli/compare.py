"""`poise compare`: a thin Typer command over poise_trl.run.compare (registered by cli/main.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.table import Table


def compare(
    recipes: list[Path] = typer.Argument(..., help="Recipes to compare, e.g. recipes/toy/{grpo,dapo,poise}.yaml"),
    budget_tokens: int = typer.Option(None, "--budget-tokens", help="Generated completion tokens per run."),
    budget_rollouts: int = typer.Option(None, "--budget-rollouts", help="Generated rollouts per run (not tokens)."),
    seeds: int = typer.Option(3, "--seeds", help="Seeds per recipe: 0 .. N-1 (from --first-seed)."),
    first_seed: int = typer.Option(0, "--first-seed", help="The first seed (each recipe runs --seeds seeds from it)."),
    eval_points: int = typer.Option(4, "--eval-points", help="Held-out evaluations at equal fractions of the budget."),
    target: str = typer.Option(
        None, "--target", help="Accuracy to reach (e.g. 0.75), or a run name (e.g. dapo) for its final mean accuracy."
    ),
    output_dir: Path = typer.Option(Path("runs/compare"), "--output-dir", "-o", help="Runs, compare.json and plots."),
    overrides: list[str] = typer.Option(None, "--set", help="key=value applied to every recipe (repeatable)."),
    max_steps: int = typer.Option(100_000, "--max-steps", help="Safety cap on optimizer steps; the budget ends runs."),
    launcher: str = typer.Option(
        None, "--launcher", help="Start each run with this, not python: e.g. 'accelerate launch --num_processes 4'."
    ),
    aggregate_only: bool = typer.Option(False, "--aggregate-only", help="Only aggregate the runs already complete."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Plain logs from the runs."),
):
    """Run recipes under the same generation budget over several seeds; writes compare.json,
    accuracy.png, training_signals.png and prints the table.

    Rerun the same command to resume: complete runs are skipped, interrupted ones resume from
    their newest complete checkpoint, and runs made with other settings are refused.
    """
    from poise_trl.cli.errors import console, fail, user_errors
    from poise_trl.run import compare as lib
    from poise_trl.run.callbacks import Budget

    try:
        if (budget_tokens is None) == (budget_rollouts is None):
            raise lib.CompareError("give exactly one budget: --budget-tokens N or --budget-rollouts N")
        if seeds < 1:
            raise lib.CompareError(f"--seeds must be >= 1, got {seeds}")
        budget = Budget("tokens", budget_tokens, eval_points) if budget_tokens is not None else Budget(
            "rollouts", budget_rollouts, eval_points)
        overrides = overrides or []
        checked, warnings = lib.check_recipes(recipes, overrides)
        for warning in warnings:
            console.print(f"[yellow]warning:[/] {warning}", highlight=False)
        runs = lib.plan_runs(recipes, list(range(first_seed, first_seed + seeds)), output_dir)
        if not aggregate_only:
            lib.execute_runs(runs, budget, overrides, max_steps, show_progress=not no_progress,
                             launcher=shlex.split(launcher) if launcher else None,
                             log=lambda line: console.print(f"[bold]compare[/] {line}", highlight=False))
        report = lib.aggregate(runs, budget, target, checked)
        written = lib.write_outputs(report, output_dir)
    except (*user_errors(), lib.CompareError) as exc:
        fail(str(exc))
        return
    console.print(f"poise compare: {budget.amount:,} generated {budget.unit} per run", highlight=False)
    for title, header, rows in lib.table_rows(report):
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="left" if column in ("run", "algo") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if any(not r["all_reached_budget"] for r in report["results"].values()):
        console.print("* some runs hit --max-steps before spending the budget")
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)
