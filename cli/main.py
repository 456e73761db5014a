"""`poise`: thin Typer commands over the library. Logic a Python user needs lives in poise_trl."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="poise-trl: RL with verifiable rewards on one node (POISE, AsyPPO, VAPO, REINFORCE++, DAPO, GRPO, RLOO).",
)
toy_app = typer.Typer(no_args_is_help=True, help="The tiny-model world: build the bundled actor and critic.")
app.add_typer(toy_app, name="toy")
console = Console()


def fail(message: str) -> None:
    """One clear line instead of a traceback (POISE_DEBUG=1 shows the traceback)."""
    if os.environ.get("POISE_DEBUG"):
        raise
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def user_errors() -> tuple[type[BaseException], ...]:
    from poise_trl.data import DatasetFormatError, DatasetUnavailableError
    from poise_trl.hub import HubPushError
    from poise_trl.recipe import RecipeError

    return (RecipeError, DatasetFormatError, DatasetUnavailableError, HubPushError, FileNotFoundError, ValueError)


@app.command(context_settings={"allow_extra_args": False})
def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/toy/grpo.yaml"),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. max_steps=20 peft.r=8"),
    output_dir: str = typer.Option(None, "--output-dir", "-o", help="Where checkpoints and summary.json go."),
    push_to_hub: bool = typer.Option(False, "--push-to-hub", help="Push the final model (needs hub_model_id)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Plain logs instead of the live display."),
):
    """Train with a recipe; writes checkpoints and OUTPUT_DIR/summary.json."""
    from poise_trl.recipe import load_recipe

    try:
        spec = load_recipe(recipe, overrides)
        if push_to_hub:
            spec["push_to_hub"] = True
        from poise_trl.train import train_from_recipe

        summary = train_from_recipe(spec, output_dir=output_dir, show_progress=not no_progress)
    except user_errors() as exc:
        fail(str(exc))
        return
    table = Table(title=f"poise train: {summary['algo']} on {summary['dataset']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    table.add_row("held-out accuracy, start", fmt(summary["start_heldout_accuracy"]))
    table.add_row("held-out accuracy, end", f"{fmt(summary['final_heldout_accuracy'])} ± {fmt(summary['final_heldout_stderr'])}")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("generated completion tokens", f"{summary['generated_tokens']:,}")
    if summary["budget"]:
        budget = summary["budget"]
        reached = "reached" if summary["budget_reached"] else "not reached (max_steps came first)"
        table.add_row("budget", f"{budget['amount']:,} {budget['unit']}, {reached}")
    table.add_row("training seconds (optimizer steps)", f"{summary['train_seconds']:.1f}")
    table.add_row("wall clock (s)", str(summary["wall_clock_seconds"]))
    table.add_row("summary", str(Path(summary["trainer_config"]["output_dir"]) / "summary.json"))
    console.print(table)


@toy_app.command("build")
def toy_build(
    output_dir: Path = typer.Option(Path("data/tiny-qwen3"), "--output-dir", "-o"),
    seed: int = typer.Option(0),
    max_steps: int = typer.Option(None, help="SFT steps (default: the bundled model's setting)."),
):
    """Build the tiny Qwen3 model: tokenizer, SFT with TRL, held-out accuracy, model card."""
    from poise_trl.toy import build_tiny_model

    kwargs = {} if max_steps is None else {"max_steps": max_steps}
    card = build_tiny_model(output_dir, seed=seed, **kwargs)
    acc = card["heldout_sampled_accuracy"]
    console.print(f"saved {output_dir}: held-out sampled accuracy {acc['accuracy']:.3f} by level {acc.get('by_level')}")


@toy_app.command("build-critic")
def toy_build_critic(
    output_dir: Path = typer.Option(Path("data/tiny-critic"), "--output-dir", "-o"),
    actor_dir: Path = typer.Option(Path("data/tiny-qwen3"), "--actor-dir", help="Initialise from this actor."),
    num_layers: int = typer.Option(2, help="Decoder blocks kept from the actor."),
    seed: int = typer.Option(0),
):
    """Build the tiny critic for AsyPPO / PPO / VAPO from the tiny actor's first blocks."""
    from poise_trl.critics import build_tiny_critic

    try:
        card = build_tiny_critic(output_dir, actor_dir=actor_dir, num_layers=num_layers, seed=seed)
    except (OSError, ValueError) as exc:
        fail(str(exc))
        return
    console.print(f"saved {output_dir}: {card.get('parameters', '?')} parameters")


def _register_commands() -> None:
    from poise_trl.cli.bench import bench
    from poise_trl.cli.compare import compare
    from poise_trl.cli.probe_eval import probe_eval

    app.command("bench")(bench)
    app.command("probe-eval")(probe_eval)
    app.command("compare")(compare)


_register_commands()

if __name__ == "__main__":
    app()
