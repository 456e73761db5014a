"""`poise`: thin Typer commands over the library. Logic a Python user needs lives in poise_trl."""

from __future__ import annotations

import inspect
import re
import sys
import typing
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from poise_trl.cli.bench import bench
from poise_trl.cli.compare import compare
from poise_trl.cli.errors import console, fail, user_errors
from poise_trl.cli.grade import grade
from poise_trl.cli.plan import plan
from poise_trl.cli.probe_eval import probe_eval
from poise_trl.core.loading import BUNDLED_DATA

# Warnings from third-party code that we cannot change, silenced by their text, each with its reason
# (tests/test_quiet_runs.py checks that a run's stderr holds no other):
# - TRL 1.16 reads `model.is_gradient_checkpointing` around every policy pass, a property transformers 5.24
#   deprecated (in TRL's code, not ours: nothing a recipe sets avoids it).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


class TidyHelp:
    """Help without typer's placeholders: `RECIPE`, not `{RECIPE}`, and no `<bool>` after flags."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.replace("{", "").replace("}", "") for piece in super().collect_usage_pieces(ctx)]

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class TidyCommand(TidyHelp, TyperCommand):
    pass


class OneLineErrors(TidyHelp, TyperGroup):
    """Usage errors (a missing argument, `--seeds abc`) as one `error:` line on stderr, like
    every other bad input, instead of click's boxed usage text."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # the base of click's usage errors in typer's bundled click
            if type(exc).__name__ == "NoArgsIsHelpError":
                from typer import rich_utils

                rich_utils.rich_format_error(exc)  # `poise` or `poise toy` alone: the help, as for --help
                sys.exit(0)
            where = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) else ""
            message = " ".join(exc.format_message().split())
            Console(stderr=True).print(f"[bold red]error:[/] {escape(message + where)}", highlight=False,
                                       soft_wrap=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            Console(stderr=True).print("[bold red]error:[/] aborted", highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="poise-trl: RL with verifiable rewards on one machine or several (POISE, AsyPPO, VAPO, REINFORCE++, "
         "DAPO, GRPO, RLOO).",
)
toy_app = typer.Typer(cls=OneLineErrors, no_args_is_help=True,
                      help="The tiny-model world: build the bundled actor and critic.")
app.add_typer(toy_app, name="toy")
recipes_app = typer.Typer(cls=OneLineErrors, no_args_is_help=True,
                          help="The recipes shipped with poise-trl: list them, copy one to edit.")
app.add_typer(recipes_app, name="recipes")


@app.command(context_settings={"allow_extra_args": False})
def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/toy/grpo.yaml."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides read as YAML, e.g. max_steps=20 peft.r=8."),
    output_dir: str = typer.Option(
        None, "--output-dir", "-o", help="Where checkpoints, summary.json and final/ go (default: the recipe's "
        "output_dir, else runs/ALGO)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a run with other settings, or a finished one, in --output-dir (by default "
        "it is refused, or reported and left untouched)."),
    push_to_hub: bool = typer.Option(False, "--push-to-hub", help="Push the final model and its card (needs "
                                     "hub_model_id in the recipe)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Plain logs instead of the live display."),
):
    """Train with a recipe; writes checkpoints, OUTPUT_DIR/summary.json and final/ (model + card).

    Rerunning the same command resumes an interrupted run from its newest complete checkpoint
    (every `save_steps` steps), also after kill -9; a finished run is reported and left
    untouched; a folder holding a run with other settings is refused unless --overwrite.
    """
    from poise_trl.run.recipe import load_recipe

    try:
        spec = load_recipe(recipe, overrides)  # before the libraries load: a bad recipe is refused at once
        if push_to_hub:
            spec["push_to_hub"] = True
        from transformers.utils import logging as hf_logging

        from poise_trl.run.train import train_from_recipe

        hf_logging.disable_progress_bar()  # the run shows its own progress; transformers' bars are noise

        summary = train_from_recipe(spec, output_dir=output_dir, show_progress=not no_progress, overwrite=overwrite,
                                    log=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except user_errors() as exc:
        fail(str(exc))
        return
    if summary.get("already_finished"):
        return
    from poise_trl.tasks import dataset_label

    table = Table(title=f"poise train: {summary['algo']} on {dataset_label(summary['dataset'])}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    table.add_row("held-out accuracy, start", fmt(summary["start_heldout_accuracy"]))
    end, stderr = fmt(summary["final_heldout_accuracy"]), fmt(summary["final_heldout_stderr"])
    table.add_row("held-out accuracy, end", f"{end} ± {stderr}")
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


@app.command()
def doctor(
    recipe: Path = typer.Argument(None, help="Recipe YAML of the run to check (its server, model, memory plan)."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides read as YAML."),
    machines: int = typer.Option(1, "--machines", help="Machines in the launch; each runs this same command."),
    node_rank: int = typer.Option(None, "--node-rank", help="This machine's index (default: NODE_RANK, GROUP_RANK "
                                  "or SLURM_NODEID, else 0)."),
    output_dir: str = typer.Option(None, "--output-dir", "-o", help="The run's output folder (default: the "
                                   "recipe's); every machine must see it."),
    rendezvous: str = typer.Option(None, "--rendezvous", help="HOST:PORT of the launch's rendezvous (default: "
                                   "MASTER_ADDR:MASTER_PORT)."),
    wait: float = typer.Option(30.0, "--wait", help="Seconds to wait for the other machines."),
):
    """Preflight of a launch on several machines, before it can hang: the same package versions everywhere,
    the rendezvous reachable, NCCL/GLOO_SOCKET_IFNAME naming real interfaces, an output folder every machine
    sees, the vLLM server answering with the recipe's model, the memory plan of one GPU. Run it on every
    machine; one line per problem with its fix, exit code 1 when there is one."""
    from poise_trl.run.doctor import run_doctor
    from poise_trl.run.recipe import load_recipe, parse_recipe

    if machines < 1 or (node_rank is not None and not 0 <= node_rank < machines):
        fail(f"--machines {machines} --node-rank {node_rank}: give --machines >= 1 and --node-rank from 0 to "
             "machines - 1")
        return
    if rendezvous is not None and not re.fullmatch(r"[^:\s]+:\d{1,5}", rendezvous):
        fail(f"--rendezvous {rendezvous!r} is not HOST:PORT: give e.g. --rendezvous 10.0.0.1:29500")
        return
    try:
        plan = parse_recipe(load_recipe(recipe, overrides), output_dir) if recipe else None
        notes, problems = run_doctor(plan, machines, node_rank, output_dir, rendezvous, wait)
    except user_errors() as exc:
        fail(str(exc))
        return
    for line in notes:
        console.print(f"ok: {escape(line)}", highlight=False, soft_wrap=True)
    for line in problems:
        console.print(f"[bold red]problem:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=1 if problems else 0)


@toy_app.command("build")
def toy_build(
    output_dir: Path = typer.Option(None, "--output-dir", "-o", help="Where the model goes (default: the bundled "
                                    "data/tiny-qwen3, or data/tiny-qwen3-multitask with --world multitask)."),
    world: str = typer.Option("toy-arith", "--world", help="toy-arith: the tiny model taught toy-arith; multitask: "
                              "that model taught three reasoning-gym tasks besides; qwen3-shape: a "
                              "random-init Qwen3 at a real geometry with Qwen3's own tokenizer (default "
                              "folder: ./qwen3-shape-SIZE); toolworld: that model taught to answer with two "
                              "dependent tool calls (default folder: ./tiny-qwen3-toolworld)."),
    size: str = typer.Option(None, "--size", help="qwen3-shape only: the geometry, 0.6b (default), 1.7b "
                             "or 4b."),
    layers: int = typer.Option(None, "--layers", help="qwen3-shape only: decoder layers (default: the real "
                               "depth); 2 keeps the vocabulary and width, fast enough for CI."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initialisation, the SFT data and the evaluation."),
    max_steps: int = typer.Option(None, "--max-steps", help="SFT steps (default: the bundled model's setting)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a model already in --output-dir (the bundled "
                                   "one by default)."),
):
    """Build a world's model: the tiny Qwen3 (tokenizer, SFT with TRL, held-out accuracy, model card), or the
    random-init Qwen3 at a real shape (--world qwen3-shape)."""
    from poise_trl.run.toy import WORLDS

    if world not in WORLDS:
        fail(f"unknown --world {world!r}; give one of {', '.join(WORLDS)}")
        return
    default_dir, build = WORLDS[world]
    options = {} if max_steps is None else {"max_steps": max_steps}
    if world == "qwen3-shape":
        if max_steps is not None:
            fail("--max-steps: the qwen3-shape world is not trained; leave it out")
            return
        options = {"size": size or "0.6b", "layers": layers}
        suffix = f"-{layers}-layers" if layers else ""
        output_dir = output_dir or Path(f"{default_dir}-{options['size']}{suffix}")
    elif size is not None or layers is not None:
        fail("--size and --layers build the qwen3-shape world: give --world qwen3-shape, or leave them out")
        return
    bundled = BUNDLED_DATA / default_dir
    output_dir = output_dir or (bundled if bundled.exists() else Path(default_dir))  # toolworld: built on demand
    try:
        card = build(output_dir, seed=seed, overwrite=overwrite, **options)
    except user_errors() as exc:
        fail(str(exc))
        return
    if world == "qwen3-shape":
        console.print(f"saved {output_dir}: {card['parameters']:,} parameters, {card['num_hidden_layers']} "
                      f"layers, vocabulary {card['vocab_size']:,}, random weights")
        return
    acc = card["heldout_sampled_accuracy"]
    breakdown = "by task" if "by_task" in acc else "by level"
    console.print(f"saved {output_dir}: held-out sampled accuracy {acc['accuracy']:.3f} {breakdown} "
                  f"{acc.get('by_task', acc.get('by_level'))}")


@toy_app.command("build-critic")
def toy_build_critic(
    output_dir: Path = typer.Option(None, "--output-dir", "-o",
                                    help="Where the critic goes (default: the bundled data/tiny-critic)."),
    actor_dir: Path = typer.Option(None, "--actor-dir",
                                   help="Initialise from this actor (default: the bundled data/tiny-qwen3)."),
    num_layers: int = typer.Option(2, "--num-layers", help="Decoder blocks kept from the actor."),
    seed: int = typer.Option(0, "--seed", help="Seed of the value-head initialisation."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a critic already in --output-dir (the bundled "
                                   "one by default)."),
):
    """Build the tiny critic for AsyPPO / PPO / VAPO from the tiny actor's first blocks."""
    from poise_trl.run.toy import build_tiny_critic, checked_output_dir

    output_dir = output_dir or BUNDLED_DATA / "tiny-critic"
    actor_dir = actor_dir or BUNDLED_DATA / "tiny-qwen3"
    try:
        card = build_tiny_critic(checked_output_dir(output_dir, overwrite), actor_dir=actor_dir,
                                 num_layers=num_layers, seed=seed)
    except (OSError, ValueError) as exc:
        fail(str(exc))
        return
    console.print(f"saved {output_dir}: {card.get('parameters', '?')} parameters")


@recipes_app.command("ls")
def recipes_ls():
    """List the shipped recipes: the NAME `poise recipes cp` and `poise train` take, the algorithm, the model."""
    from poise_trl.run.recipe import bundled_recipes, read_yaml

    table = Table(title="shipped recipes (poise recipes cp NAME [DEST])")
    for column in ("name", "algo", "model"):
        table.add_column(column)
    for name, path in bundled_recipes().items():
        recipe = read_yaml(path.read_text()) or {}
        if "distributed_type" in recipe:
            table.add_row(name, "accelerate config", "")
        else:
            table.add_row(name, recipe.get("algo", "grpo"), str(recipe.get("model", "data/tiny-qwen3")))
    console.print(table)


@recipes_app.command("cp")
def recipes_cp(
    name: str = typer.Argument(..., help="A shipped recipe: toy/poise, or poise where the name is unique."),
    dest: Path = typer.Argument(None, help="File or existing folder to copy to (default: ./NAME.yaml)."),
):
    """Copy a shipped recipe to edit; an existing file is never overwritten."""
    from poise_trl.run.recipe import find_bundled_recipe

    try:
        source = find_bundled_recipe(name)
        dest = dest or Path(source.name)
        dest = dest / source.name if dest.is_dir() else dest
        with open(dest, "x") as out:  # "x": refuses an existing file, even one made since the check
            out.write(source.read_text())
    except FileExistsError:
        fail(f"{dest} already exists: give another DEST, or move that file away first")
        return
    except user_errors() as exc:
        fail(str(exc))
        return
    console.print(f"copied {source.relative_to(source.parents[1])} to {dest}", highlight=False)


def as_paragraphs(text: str) -> str:
    """Help text whose source line breaks inside a paragraph are gone, so the terminal wraps it; blank lines
    between paragraphs and the breaks before list items ("- ") stay."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(re.sub(r"\n(?!- )", " ", paragraph) for paragraph in paragraphs)


def _tidy_help(typer_app: typer.Typer) -> None:
    """Help without typer's placeholders: arguments as RECIPE (not `{recipe}`), flags without
    `<bool>`. Sets the metavar of every parameter that has none, for every command, and makes each
    command's docstring paragraphs."""
    for info in typer_app.registered_commands:
        info.cls = TidyCommand if info.cls in (None, TyperCommand) else info.cls
        info.help = as_paragraphs(info.help or inspect.getdoc(info.callback) or "")
        for param in inspect.signature(info.callback).parameters.values():
            spec = param.default
            if not isinstance(spec, (typer.models.OptionInfo, typer.models.ArgumentInfo)) or spec.metavar is not None:
                continue
            annotation = typing.get_type_hints(info.callback).get(param.name)
            if isinstance(spec, typer.models.ArgumentInfo):
                spec.metavar = param.name.upper()
            elif annotation is bool:
                spec.metavar = ""
    for group in typer_app.registered_groups:
        _tidy_help(group.typer_instance)


app.command("bench")(bench)
app.command("probe-eval")(probe_eval)
app.command("compare")(compare)
app.command("grade")(grade)
app.command("plan")(plan)
_tidy_help(app)

if __name__ == "__main__":
    app()
