"""``dspec data regenerate --server``: option checks and the progress bar of the server path."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn, TimeRemainingColumn

from dspec_cli.cli.progress import CommandProgress
from dspec_cli.training.regenerate import RegenerateOptions, RegenerateStats


def run_with_servers(opts: RegenerateOptions, servers: list[str], concurrency: int, model: str | None,
                     max_retries: int, timeout: float, *, console: Console) -> RegenerateStats:
    """Regenerate through ``servers`` with a progress bar on ``console``."""
    from dspec_cli.training.regenerate_server import (
        ServerOptions,
        regenerate_with_servers,
    )

    sopts = ServerOptions(servers=servers, concurrency=concurrency, model=model, max_retries=max_retries,
                          timeout=timeout)
    with CommandProgress(console, MofNCompleteColumn(), TextColumn("conversations · {task.fields[rate]}"),
                         TimeRemainingColumn(), unit="conversations") as bar:

        def progress(total: int):
            task = bar.add_task("regenerate", total=total, rate="")
            t0, tokens = time.perf_counter(), [0]

            def tick(new_tokens: int) -> None:
                tokens[0] += new_tokens
                dt = max(time.perf_counter() - t0, 1e-9)
                done = bar.tasks[task].completed + 1
                bar.update(task, advance=1, rate=f"{done / dt:.2f} conv/s, {tokens[0] / dt:.0f} tok/s")

            return tick

        return regenerate_with_servers(opts, sopts, progress)
