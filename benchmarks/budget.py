"""Run a benchmark's parts within a time budget: most valuable first, each in its own process.

The driver (:func:`run_parts`) gives each part the time its cap allows and the budget has left,
skips the parts that no longer fit, and hands the report to ``on_update`` after every part: a
part that fails, hangs or runs out of time costs only itself, and a budget that ends early loses
only what was not run. A part runs in a child process (:func:`launch`) that saves its results as
it goes (:class:`Progress`), so even a part that is stopped keeps what it measured, next to the
tail of its output (a traceback, when it failed).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARGIN = 3.0  # seconds kept back for the driver's own work after the last part
GRACE = 8.0  # seconds between a part's own deadline and its kill: time to save what it has
TAIL = 30  # lines of a failed part's output kept in the report


@dataclass(frozen=True)
class Part:
    name: str
    cap: float  # most seconds it may take
    least: float = 15.0  # fewer seconds left than this: not started


@dataclass
class Outcome:
    """What one part's process left: its results (possibly partial) and, if it did not finish
    cleanly, why and the tail of its output."""

    result: dict | None
    error: str | None = None
    tail: list[str] | None = None


class Progress:
    """A part's side of the protocol: ``save`` its results as they grow (atomic JSON writes) and
    ``left`` seconds until its deadline (check it between measurements)."""

    def __init__(self, path: Path | None, until: float | None):
        self.path, self.until = path, until

    def left(self) -> float:
        return float("inf") if self.until is None else self.until - time.time()

    def save(self, result: dict) -> dict:
        if self.path is not None:
            write_json(self.path, result)
        return result


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def launch(cmd: list[str], out: Path, timeout: float) -> Outcome:
    """Run ``cmd`` (a part that writes its results to ``out``) for at most ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()  # its own session: the part's process only
        output, _ = proc.communicate()
        error = f"stopped after {timeout:.0f} s"
    result = json.loads(out.read_text()) if out.exists() else None
    tail = output.strip().splitlines()[-TAIL:] if error else None
    if error is None and result is None:
        error, tail = "no results written", output.strip().splitlines()[-TAIL:]
    return Outcome(result, error, tail)


def run_parts(parts: list[Part], budget: float, run: Callable[[Part, float], Outcome],
              on_update: Callable[[dict], None], clock: Callable[[], float] = time.monotonic) -> dict:
    """Run ``parts`` in order within ``budget`` seconds: ``run(part, seconds)`` runs one for at
    most that long. Returns the report: each part's results under its name, ``errors`` (error
    and output tail), ``seconds`` per part, ``skipped`` (no time left), ``budget``."""
    end = clock() + budget
    report: dict = {"budget": budget, "errors": {}, "seconds": {}, "skipped": []}
    for part in parts:
        left = end - clock() - MARGIN
        if left < part.least:
            report["skipped"].append(part.name)
            on_update(report)
            continue
        t0 = clock()
        outcome = run(part, min(part.cap, left))
        report["seconds"][part.name] = clock() - t0
        if outcome.result is not None:
            report[part.name] = outcome.result
        if outcome.error is not None:
            report["errors"][part.name] = {"error": outcome.error, "tail": outcome.tail or []}
        on_update(report)
    return report
