"""Progress bars of the long evaluation jobs (`bench`, `probe-eval`), on stderr so results stay on stdout."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def progress_bars(label: str, unit: str | None = None, enabled: bool = True):
    """Rich progress bars on stderr for the evaluation tools (`bench`, `probe-eval`), or None."""
    if not enabled:
        yield None
        return
    columns = [TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn(unit)] if unit else []
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield progress
