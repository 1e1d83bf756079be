"""``dspec schedule``: offline load simulation of verification schedulers on recorded traces."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.options import int_list
from dspec_cli.cli.progress import results_console
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.records import MAX_TOKENS
from dspec_cli.core.run_paths import RunPaths


@app.command("schedule")
def schedule_command(
    ctx: typer.Context,
    cost_table: Path = typer.Option(..., "--cost-table", help="Cost table JSON from `dspec profile-hardware`, or an SGLang DSpark SPS table."),
    traces: Path = typer.Option(..., "--traces", help="Round traces of one verification rule: jsonl from `dspec calibrate --save-traces`, or SGLang STS shards (<stem>.N.pt: give the stem; the token rule)."),
    scheduler: list[str] = typer.Option(["hardware"], "--scheduler", "-s", help="Scheduler (repeatable): NAME[,KEY=VALUE...]: fixed, threshold, hardware, async, or a plugin's (e.g. hardware,gate=false)."),
    concurrency: str = opt.concurrency_list("1,4,16,64"),
    steps: Optional[int] = opt.int_option(None, "--steps", minimum=1, maximum=10_000_000, help="Simulated rounds per (scheduler, R), >= 1 (default: one pass over the traces, every record once)."),
    layout: str = typer.Option("padded", "--layout", help="How the simulated engine lays out a ragged verify: padded (R·(1 + max ℓ) tokens, dspec's engine and bench's hardware scheduler) or packed (Σ(ℓ+1) tokens, the paper's engines)."),
    threshold: float = opt.float_option(0.5, "--threshold", help="Threshold of the 'threshold' scheduler."),
    context: Optional[int] = opt.int_option(None, "--context", minimum=0, maximum=MAX_TOKENS, help="Context length for SPS lookups (default: mean over the profiled contexts)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="calibration.json whose fit for the traces' verification rule is applied to their confidences."),
    target: Optional[str] = typer.Option(None, "--target", metavar="PATH|HUB_ID", help="The model the results are for: a cost table profiled for another one warns."),
    device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE", help="The device the results are for (auto, cpu, cuda or cuda:N): a cost table profiled on another one warns (default: no check)."),
    strict: bool = opt.strict("a cost-table mismatch"),
    seed: int = opt.seed(),
    json_path: Optional[Path] = opt.json_path("the results"),
    plots: Optional[Path] = opt.plots("schedule.png, throughput and budget against R"),
) -> None:
    """Mean verification budget per request and expected throughput τ·SPS(B) under load (paper Fig. 8)."""
    import torch

    from dspec_cli.core.calibration import (
        UNRECORDED_RULE,
        Calibration,
        CalibrationRuleMismatch,
    )
    from dspec_cli.core.devices import resolve_device
    from dspec_cli.core.errors import DspecError
    from dspec_cli.core.hardware import CostTable
    from dspec_cli.core.specs import parse_scheduler_spec
    from dspec_cli.runtime.schedule import build_scheduler
    from dspec_cli.workflows.sglang_sts import load_rounds
    from dspec_cli.workflows.simulate import simulate_load

    if not 0 <= threshold <= 1:
        raise DspecError(f"--threshold must be in [0, 1], got {threshold}")
    if not any(parse_scheduler_spec(spec)[0] == "threshold" for spec in scheduler):
        opt.refuse(ctx, ("threshold",), "without --scheduler threshold", "to the threshold scheduler")
    levels = int_list(concurrency, "--concurrency", maximum=opt.MAX_CONCURRENCY)
    if layout not in ("packed", "padded"):
        raise DspecError(f"--layout must be packed or padded, got {layout!r}")
    RunPaths().read("--cost-table", cost_table).read("--traces", *opt.trace_files(traces)) \
        .read("--calibration", calibration).write("--json", json_path, stream=True) \
        .write_folder("--plots", plots, files=("schedule.png",)).check()
    rounds, meta = load_rounds(traces)
    rule = meta["verify"] or UNRECORDED_RULE  # traces that record none: the token rule's
    table = CostTable.load(cost_table, block_size=meta["block_size"])
    err = Console(stderr=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = table.check(device=resolve_device(device) if device else None, model=target, strict=strict)
    for p in problems:
        warnings.warn(f"{p} (use --strict to make this an error)", stacklevel=1)
    if calibration:  # recorded confidences are raw: calibrate them as the engine would
        cal = Calibration.load(calibration, drafter=meta["drafter"] or None, block_size=meta["block_size"],
                               what="--calibration")
        message = cal.rule_warning(rule, meta["drafter"])
        if message:
            warnings.warn(message, CalibrationRuleMismatch, stacklevel=1)
        elif meta["verify"] is None and len(cal.rules) > 1:
            warnings.warn(f"traces {traces} record no verification rule: the calibration's {rule} rule fit is "
                          "applied", stacklevel=1)
        rounds = rounds.calibrated(cal.fit(rule))
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
    how = f"{rule} rule" if meta["verify"] else f"no rule recorded: {rule}"
    view = Table(title=f"schedulers on {len(rounds)} recorded rounds ({how}) · {table.model} · {table.device_name}")
    for col in ("scheduler", "R", "draft ℓ", "budget ℓ+1", "τ", "pred. τ", "tok/s", "plain tok/s", "speedup"):
        view.add_column(col, justify="left" if col == "scheduler" else "right")
    for r in results:
        view.add_row(r["scheduler"], str(r["concurrency"]), f"{r['mean_draft_len']:.2f}", f"{r['budget']:.2f}",
                     f"{r['tau']:.2f}", f"{r['predicted_tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['plain_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x")
    if not is_stdout(json_path):
        results_console().print(view)
    report = {"cost_table": str(cost_table), "traces": str(traces), "num_rounds": len(rounds),
              "trace_tau": 1 + float(rounds.accepted.double().mean()),  # full-length verification, as recorded
              "drafter": meta["drafter"], "block_size": meta["block_size"], "verify": rule,
              "calibration": str(calibration) if calibration else None, "layout": layout, "results": results}
    if json_path is not None:
        opt.wrote(err, write_json(json_path, report))
    if plots is not None:
        from dspec_cli.workflows.plots import schedule_plot

        title = f"{table.model} · {table.device_name} ({table.dtype}) · {layout} verify · {meta['drafter'] or 'drafter'}"
        opt.wrote(err, schedule_plot(results, plots / "schedule.png", title))
