"""The commands' progress: a rich bar on a terminal; in logs (stderr not a terminal: nohup, SLURM,
CI) one line every few seconds with done/total, rate and ETA."""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

LOG_INTERVAL = float(os.environ.get("DSPEC_PROGRESS_INTERVAL", "5"))  # seconds between log lines


PIPED_WIDTH = 240  # tables written to a file or pipe without COLUMNS: wide enough not to fold


def results_console() -> Console:
    """stdout for tables: as wide as the terminal, else ``COLUMNS`` (rich reads it), else
    :data:`PIPED_WIDTH` (a log file should hold the whole table, not columns folded to 80)."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPED_WIDTH)
    return console


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class LogLines:
    """Progress as plain lines: ``desc: done/total · rate/s · ETA m:ss``, at most one per ``interval``
    seconds per task, and a last one when a task that printed completes."""

    def __init__(self, console: Console, unit: str = "", interval: float = LOG_INTERVAL):
        self.console, self.unit, self.interval = console, unit, interval
        self._start: dict[object, float] = {}
        self._last: dict[object, float] = {}

    def tick(self, key: object, desc: str, done: float, total: float | None, extra: str = "", base: float = 0) -> None:
        """Report task ``key``; ``base``: what was already done when it started (a resumed run)."""
        now = time.monotonic()
        start = self._start.setdefault(key, now)
        finished = total is not None and done >= total
        if now - self._last.get(key, start) < self.interval and not (finished and key in self._last):
            return  # quiet until an interval has passed; a task that ends sooner never prints
        self._last[key] = now
        elapsed = now - start
        rate = (done - base) / elapsed if elapsed > 0 else 0.0
        parts = [f"{desc}: {done:g}/{total:g}" if total is not None else f"{desc}: {done:g}"]
        unit = f" {self.unit}" if self.unit else ""
        if elapsed > 0:
            parts.append(f"{rate:.2f}{unit}/s")
        if finished:
            parts.append(f"done in {_clock(elapsed)}")
        elif total is not None and rate > 0:
            parts.append(f"ETA {_clock((total - done) / rate)}")
        if extra:
            parts.append(extra)
        self.console.print(" · ".join(parts), markup=False, highlight=False, soft_wrap=True)


class CommandProgress(Progress):
    """description · bar · ``columns`` (default: done/total) · elapsed; transient.

    The bar starts with its first task, so an input error found before any work prints as one
    line. When stderr is not a terminal the bar is off and :class:`LogLines` reports instead.
    Use as a context manager.
    """

    def __init__(self, console: Console, *columns: ProgressColumn, unit: str = "", interval: float = LOG_INTERVAL):
        super().__init__(
            TextColumn("{task.description}"), BarColumn(), *(columns or (MofNCompleteColumn(),)), TimeElapsedColumn(),
            console=console, transient=True, disable=not console.is_terminal,
        )
        self.lines = LogLines(console, unit, interval) if self.disable else None

    def __enter__(self) -> CommandProgress:
        return self

    def add_task(self, *args, **kwargs) -> TaskID:
        if not self.live.is_started:
            self.start()
        return super().add_task(*args, **kwargs)

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        if self.lines is not None:
            task = self._tasks[task_id]
            self.lines.tick(task_id, task.description, task.completed, task.total)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        self.update(task_id, advance=advance)
