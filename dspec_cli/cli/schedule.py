"""``dspec schedule``: offline load simulation of verification schedulers on recorded traces."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli.profile import int_list


@app.command("schedule")
def schedule_command(
    cost_table: Path = typer.Option(..., "--cost-table", help="Cost table JSON from `dspec profile-hardware`, or an SGLang DSpark SPS table."),
    traces: Path = typer.Option(..., "--traces", help="Round traces: jsonl from `dspec calibrate --save-traces`, or SGLang STS shards (<stem>.N.pt: give the stem)."),
    scheduler: list[str] = typer.Option(["hardware"], "--scheduler", "-s", help="Scheduler (repeatable): fixed, threshold, hardware, async, or a plugin's; options as NAME,key=value (e.g. hardware,layout=padded)."),
    concurrency: str = typer.Option("1,4,16,64", "--concurrency", help="Concurrent requests R, e.g. 1,4,16,64."),
    steps: int = typer.Option(200, "--steps", help="Simulated rounds per (scheduler, R)."),
    layout: str = typer.Option("packed", "--layout", help="How the simulated engine lays out a ragged verify: packed (cost of Σ(ℓ+1) tokens, the paper's engines) or padded (R·(1 + max ℓ), dspec's engine)."),
    threshold: float = typer.Option(0.5, "--threshold", help="Threshold of the 'threshold' scheduler."),
    context: Optional[int] = typer.Option(None, "--context", help="Context length for SPS lookups (default: mean over the profiled contexts)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="calibration.json whose temperatures are applied to the trace confidences."),
    target: Optional[str] = typer.Option(None, "--target", help="Warn if the cost table was profiled for another model."),
    device: Optional[str] = typer.Option(None, "--device", help="Warn if the cost table was profiled on another device than this machine's DEVICE."),
    strict: bool = typer.Option(False, "--strict", help="Make a cost-table mismatch an error."),
    seed: int = typer.Option(0, "--seed"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG (throughput and budget against R)."),
) -> None:
    """Mean verification budget per request and expected throughput τ·SPS(B) under load (paper Fig. 8)."""
    import torch

    from dspec_cli.core.calibration import Calibration
    from dspec_cli.core.errors import DspecError
    from dspec_cli.core.hardware import CostTable
    from dspec_cli.core.specs import parse_scheduler_spec
    from dspec_cli.runtime.schedule import build_scheduler
    from dspec_cli.workflows.sglang_sts import load_rounds
    from dspec_cli.workflows.simulate import simulate_load

    levels = int_list(concurrency, "--concurrency")
    if steps < 1:
        raise DspecError(f"--steps must be >= 1, got {steps}")
    rounds, meta = load_rounds(traces)
    table = CostTable.load(cost_table, block_size=meta["block_size"])
    err = Console(stderr=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = table.check(device=device, model=target, strict=strict)
    for p in problems:
        err.print(f"Warning: {p} (use --strict to make this an error)", markup=False)
    if calibration:  # recorded confidences are raw: calibrate them as the engine would
        cal = Calibration.load(calibration, drafter=meta["drafter"] or None, block_size=meta["block_size"])
        rounds = rounds.with_temperatures(cal.temperatures)
    results = []
    for spec in scheduler:
        name, options = parse_scheduler_spec(spec)
        if name == "threshold":
            options.setdefault("threshold", threshold)
        sched = build_scheduler(name, table, context=context, **options)
        for R in levels:
            gen = torch.Generator().manual_seed(seed)
            res = simulate_load(sched, rounds, table, concurrency=R, steps=steps, generator=gen, layout=layout)
            results.append({**res, "scheduler": spec})
    out = Console()
    console = out if out.is_terminal else Console(width=200)
    view = Table(title=f"schedulers on {len(rounds)} recorded rounds · {table.model} · {table.device_name}")
    for col in ("scheduler", "R", "draft ℓ", "budget ℓ+1", "τ", "pred. τ", "tok/s", "plain tok/s", "speedup"):
        view.add_column(col, justify="left" if col == "scheduler" else "right")
    for r in results:
        view.add_row(r["scheduler"], str(r["concurrency"]), f"{r['mean_draft_len']:.2f}", f"{r['budget']:.2f}",
                     f"{r['tau']:.2f}", f"{r['predicted_tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['plain_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x")
    console.print(view)
    report = {"cost_table": str(cost_table), "traces": str(traces), "num_rounds": len(rounds),
              "drafter": meta["drafter"], "block_size": meta["block_size"],
              "calibration": str(calibration) if calibration else None, "results": results}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        err.print(f"wrote {json_path}")
    if plot is not None:
        from dspec_cli.workflows.plots import schedule_plot

        err.print(f"wrote {schedule_plot(results, plot)}")
