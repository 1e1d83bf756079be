"""``dspec bench``: benchmark drafters against plain decoding of the same target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.bench import BenchOptions, drafted_share, format_speedup, run_bench
from dspec_cli.cli import app
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.errors import DspecError


def _concurrency(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DspecError(f"--concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise DspecError(f"--concurrency values must be >= 1, got {text!r}")
    return values


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def render_table(report: dict, console: Console) -> None:
    table = Table(title=f"dspec bench · target {report['target']} · {report['env']['device']}")
    for col in ("dataset", "drafter", "scheduler", "R", "τ", "tok/s", "per user", "base tok/s", "speedup", "budget", "cond. accept by position", "draft %", "drafted"):
        left = col in ("dataset", "drafter", "scheduler", "cond. accept by position")
        table.add_column(col, justify="left" if left else "right", no_wrap=col in ("dataset", "drafter", "scheduler"))
    for run in report["runs"]:
        cond = " ".join(_fmt(c, ".2f") for c in run["cond_accept"])
        table.add_row(
            run["dataset"], run["drafter"], run["scheduler"], str(run["concurrency"]), _fmt(run["tau"]),
            _fmt(run["tokens_per_s"], ".1f"), _fmt(run["per_user_tokens_per_s"], ".1f"),
            _fmt(run["baseline_tokens_per_s"], ".1f"), format_speedup(run), _fmt(run["mean_verify_budget"]), cond,
            _fmt(100 * run["draft_time_share"], ".0f"), _fmt(100 * drafted_share(run), ".0f") + "%",
        )
    console.print(table)


def render_domains(rows: list[dict], console: Console) -> None:
    table = Table(title="τ per domain (mean over the sets of each domain)")
    for col in ("drafter", "scheduler", "R", "math", "code", "chat"):
        table.add_column(col, justify="left" if col in ("drafter", "scheduler") else "right")
    for r in rows:
        table.add_row(r["drafter"], r["scheduler"], str(r["concurrency"]), _fmt(r["math"]), _fmt(r["code"]), _fmt(r["chat"]))
    console.print(table)


@app.command("bench")
def bench_command(
    drafter: list[str] = typer.Option(..., "--drafter", "-d", help="Drafter (repeatable): NAME[:BASE][,KEY=VALUE...] with config options, e.g. ddtree:dspark,tree_budget=64."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model: local path or Hub id (default: the embedded tiny target)."),
    checkpoint: list[str] = typer.Option([], "--checkpoint", help="Drafter checkpoint (path or Hub id), one per --drafter in order."),
    dataset: list[str] = typer.Option([], "--dataset", help="jsonl prompt file with {\"turns\": [...]} lines, or a set from `dspec datasets` (repeatable; default: built-in prompts)."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use the first N prompts of each dataset."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    block_size: int = typer.Option(7, "--block-size", help="γ: most draft tokens verified per round."),
    seed: int = typer.Option(0, "--seed"),
    repeats: int = typer.Option(1, "--repeats", help="Timed runs per engine, round-robin with the baseline; tokens/s is the median, speedup the median of per-repeat ratios."),
    concurrency: str = typer.Option("1", "--concurrency", help="Concurrent requests, e.g. 1,4,16."),
    scheduler: list[str] = typer.Option(["fixed"], "--scheduler", help="Verification-length scheduler (repeatable): NAME[,KEY=VALUE...], e.g. fixed, threshold,threshold=0.6, hardware, hardware,gate=false, async."),
    cost_table: Optional[Path] = typer.Option(None, "--cost-table", help="Cost table from `dspec profile-hardware --json` (hardware/async schedulers)."),
    strict: bool = typer.Option(False, "--strict", help="A cost table from another device or model is an error, not a warning."),
    device: str = typer.Option("cpu", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the full report as JSON here."),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Write PNGs here: acceptance by position; with several concurrencies, throughput and budget under load."),
    suite: Optional[str] = typer.Option(None, "--suite", help="paper = the paper's nine evaluation sets with their caps (see `dspec datasets`); prints τ per domain."),
) -> None:
    """Measure τ, acceptance by position and speedup over plain decoding of the same target."""
    if num_prompts is not None and num_prompts < 1:
        raise DspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if suite is not None:
        from dspec_cli.datasets import PAPER_SUITE

        if suite != "paper":
            raise DspecError(f"--suite must be 'paper', got {suite!r}")
        dataset = [*PAPER_SUITE, *dataset]
    opts = BenchOptions(
        drafters=drafter, target=target, checkpoints=checkpoint, datasets=dataset, num_prompts=num_prompts,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, block_size=block_size,
        seed=seed, concurrency=_concurrency(concurrency), device=device, dtype=dtype,
        schedulers=scheduler, cost_table=str(cost_table) if cost_table else None, strict=strict, repeats=repeats,
    )
    err = Console(stderr=True)
    with CommandProgress(err) as bar:

        def progress(desc: str, total: int):
            task = bar.add_task(desc, total=total)
            return lambda _res: bar.advance(task)

        report = run_bench(opts, progress)
    out = Console()
    render_table(report, out if out.is_terminal else Console(width=200))
    if suite is not None:
        from dspec_cli.datasets import domain_tau

        report["domains"] = domain_tau(report["runs"])
        render_domains(report["domains"], out if out.is_terminal else Console(width=200))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        err.print(f"wrote {json_path}")
    if plots is not None and report["runs"]:
        from dspec_cli.plots import acceptance_plot, load_plots

        written = [acceptance_plot(report["runs"], plots / "acceptance.png")]
        if len(opts.concurrency) > 1:
            written += load_plots(report["runs"], plots)
        err.print("wrote " + ", ".join(str(p) for p in written))
