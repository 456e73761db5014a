"""What every command shares: the consoles and the one-line error a user sees instead of a traceback."""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str) -> None:
    """One clear line on stderr instead of a traceback (POISE_DEBUG=1 shows the traceback)."""
    if os.environ.get("POISE_DEBUG"):
        raise
    message = " ".join(str(message).split())  # one line, whatever the library's message looks like
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def user_errors() -> tuple[type[BaseException], ...]:
    from poise_trl.core.distributed import LostRankError
    from poise_trl.run.hub import HubPushError
    from poise_trl.run.recipe import RecipeError
    from poise_trl.tasks.prompts import DatasetFormatError, DatasetUnavailableError

    return (LostRankError, RecipeError, DatasetFormatError, DatasetUnavailableError, HubPushError, FileNotFoundError,
            ValueError)
