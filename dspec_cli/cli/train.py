"""``dspec train``: train a drafter from a TOML recipe (single process or under torchrun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import LogLines
from dspec_cli.core.outputs import is_stdout


class RichProgress:
    """Progress bar with loss, τ_probabilistic and tokens/s (rank 0 only)."""

    def __init__(self, console: Console):
        self.console = console
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        self.lines = None if console.is_terminal else LogLines(console, "steps")
        self.title, self.total, self.first = "", 0, 0

    def start(self, total: int, done: int, title: str) -> None:
        self.title, self.total, self.first = title, total, done
        if self.lines is not None:  # a log: a line every few seconds, not a bar cut to 80 columns
            return
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
        )
        self.bar.start()
        self.task = self.bar.add_task(title, total=total, completed=done, stats="")

    def update(self, row: dict) -> None:
        stats = f"loss {row['loss']:.4f}"
        tau = row.get("tau_probabilistic", row.get("tau"))
        if tau is not None:
            stats += f" · τ {tau:.2f}"
        stats += f" · {row['tokens_per_s']:,.0f} tok/s"
        if self.lines is not None:
            self.lines.tick(self, self.title, row["step"], self.total, stats, base=self.first)
            return
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=row["step"], stats=stats)

    def note(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@app.command("train")
def train_command(
    overrides: Optional[list[str]] = typer.Argument(None, help="Recipe overrides, e.g. train.lr=3e-4 drafter.num_anchors=256."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter to train (default: the recipe's drafter.name)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", "-r", help="TOML recipe (optional with --resume)."),
    target: Optional[str] = typer.Option(None, "--target", metavar="PATH|HUB_ID", help="Expected target; must match the recipe's target.name."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run folder (default: runs/<recipe folder>-<drafter>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --output from its latest checkpoint."),
    max_steps: Optional[int] = opt.int_option(None, "--max-steps", minimum=1, help="Total optimizer steps (= train.max_steps)."),
    stop_after: Optional[int] = opt.int_option(None, "--stop-after", minimum=1, help="Stop with a checkpoint after this many steps."),
    json_log: Optional[Path] = typer.Option(None, "--json-log", metavar="FILE|-", help="Metrics JSONL ('-': stdout; default: OUT/train_log.jsonl)."),
    feature_cache: Optional[Path] = typer.Option(None, "--feature-cache", help="Folder caching target features (reused when present)."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from this drafter checkpoint's weights (fine-tuning; new optimizer and schedule)."),
    report_to: list[str] = typer.Option([], "--report-to", help="Also log metrics to: tensorboard (OUT/tensorboard; needs dspec[tensorboard])."),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(recipe=True),
) -> None:
    """Train a drafter for a target: online target features, AdamW + warmup/cosine, atomic checkpoints."""
    from transformers.utils import logging as hf_logging

    from dspec_cli.training.loop import TrainOptions, train

    hf_logging.disable_progress_bar()
    opts = TrainOptions(
        recipe=recipe, drafter=drafter, overrides=overrides or [], output=output, target=target, resume=resume,
        max_steps=max_steps, stop_after=stop_after, json_log=json_log, feature_cache=feature_cache, init_from=init_from,
        report_to=report_to,
        chat_template_kwargs=None if chat_template_kwargs is None else opt.template_kwargs(chat_template_kwargs),
    )
    err = Console(stderr=True)
    bar = RichProgress(err)
    try:
        result = train(opts, bar)
    finally:
        bar.close()
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports
        return
    summary = ", ".join(f"{k} {result.metrics[k]:.4g}" for k in ("loss", "tau_probabilistic") if k in result.metrics)
    out = sys.stderr if is_stdout(json_log) else sys.stdout  # stdout holds the streamed metrics only
    if result.finished:
        print(f"trained {result.step} steps ({summary}); drafter checkpoint: {result.output}", file=out)
    else:
        print(f"stopped at step {result.step}/{result.total_steps} ({summary}); "
              f"continue with: dspec train --resume --output {result.output}", file=out)
    if result.interrupted:
        raise KeyboardInterrupt  # the checkpoint is written: report "Interrupted", exit 130
