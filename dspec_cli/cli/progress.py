"""The commands' progress bars: rich on stderr, drawn on a terminal only, started by the first task."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)


class CommandProgress(Progress):
    """description · bar · ``columns`` (default: done/total) · elapsed; transient.

    The bar starts with its first task, so an input error found before any work prints as one
    line, and it is off when stderr is not a terminal (a log gets the results, not a stray
    blank line from a transient bar). Use as a context manager.
    """

    def __init__(self, console: Console, *columns: ProgressColumn):
        super().__init__(
            TextColumn("{task.description}"), BarColumn(), *(columns or (MofNCompleteColumn(),)), TimeElapsedColumn(),
            console=console, transient=True, disable=not console.is_terminal,
        )

    def __enter__(self) -> CommandProgress:
        return self

    def add_task(self, *args, **kwargs):
        if not self.live.is_started:
            self.start()
        return super().add_task(*args, **kwargs)
