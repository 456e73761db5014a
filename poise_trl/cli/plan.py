"""`poise plan`: a thin Typer command over poise_trl.run.plan (registered by cli/main.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from poise_trl.cli.errors import console, fail, user_errors


def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/gpu/poise_qwen3-4b.yaml"),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. per_device_train_batch_size=8"),
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs, 1 or more (default: the recipe's gpus, else the "
                             "accelerate config's)."),
    machines: int = typer.Option(None, "--machines", min=1, help="Machines of a multi-node launch (with "
                                 "--gpus-per-machine: their product replaces --gpus)."),
    gpus_per_machine: int = typer.Option(None, "--gpus-per-machine", min=1, help="GPUs on each machine (default 1)."),
    gpu_memory: str = typer.Option("80GB", "--gpu-memory", help="Memory of one GPU, e.g. 80GB or 141GB."),
    accelerate_config: Path = typer.Option(
        None, "--accelerate-config", help="accelerate config to launch with (default: the recipe's accelerate_config)."
    ),
    prompt_length: int = typer.Option(512, "--prompt-length", help="Prompt tokens assumed (chat template included)."),
):
    """Per-GPU memory of a recipe from the model's config alone (weights are never downloaded):
    weights, gradients, AdamW state, activations, LM head, vLLM, critics; fits or which change makes it fit."""
    from poise_trl.run.recipe import load_recipe, parse_recipe

    if machines is not None or gpus_per_machine is not None:
        if gpus is not None:
            fail("--gpus with --machines/--gpus-per-machine: give either the total (--gpus) or the layout")
            return
        gpus = (machines or 1) * (gpus_per_machine or 1)
    try:
        spec = load_recipe(recipe, overrides)  # before torch and TRL load (run.plan imports them)
        from poise_trl.run.plan import GIB, Sharding, parse_memory, plan_recipe, sharding_from_accelerate_config

        gpu_bytes = parse_memory(gpu_memory)
        config_path = accelerate_config or spec.get("accelerate_config")
        sharding = sharding_from_accelerate_config(config_path) if config_path else Sharding()
        result = plan_recipe(parse_recipe(spec), gpus=gpus or spec.get("gpus"), gpu_bytes=gpu_bytes,
                             sharding=sharding, prompt_length=prompt_length)
    except user_errors() as exc:
        fail(str(exc))
        return
    table = Table(title=f"poise plan: {spec.get('algo', 'grpo')} with {result.model} ({result.parameters / 1e9:.2f}B "
                        f"params, {result.tokens_per_micro_batch:,} tokens per micro-batch)")
    table.add_column("item")
    table.add_column("GiB per GPU", justify="right")
    table.add_column("how")
    for item in result.items:
        table.add_row(item.name, f"{item.bytes / GIB:.2f}", item.note)
    table.add_row("total", f"{result.total / GIB:.2f}", f"of {result.gpu_bytes / GIB:.1f} GiB", style="bold")
    console.print(table)
    console.print(result.verdict(), style="green" if result.fits else "red", highlight=False, soft_wrap=True)

