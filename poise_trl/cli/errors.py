"""What every command shares: the consoles and the one-line error a user sees instead of a traceback."""

from __future__ import annotations

import os
import sys

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


# The errors a user fixes (beyond ValueError, which RecipeError and DatasetFormatError are), by module: an error
# class of a module not imported yet cannot have been raised, so a refusal before the libraries load stays fast.
USER_ERRORS = {"poise_trl.run.hub": "HubPushError", "poise_trl.tasks.prompts": "DatasetUnavailableError",
               "poise_trl.core.distributed": "LostRankError"}


def user_errors() -> tuple[type[BaseException], ...]:
    loaded = [getattr(sys.modules[module], name) for module, name in USER_ERRORS.items() if module in sys.modules]
    return (FileNotFoundError, ValueError, *loaded)
