"""``dspec profile-hardware``: measure SPS(B) of the target forward and write the cost table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.core.errors import DspecError


def int_list(text: str, option: str, minimum: int = 1) -> list[int]:
    """Parse "1,4,16" for ``option``; every value must be >= minimum."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DspecError(f"{option} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise DspecError(f"{option} values must be >= {minimum}, got {text!r}")
    return values


def render_cost_table(table, console: Console, max_rows: int = 24) -> None:
    """Steps/s per B (rows) and context (columns); long grids are thinned for display."""
    out = Table(title=f"SPS(B) · {table.model} · {table.device_name} · {table.dtype}")
    out.add_column("B", justify="right")
    for ctx in table.contexts:
        out.add_column(f"ctx {ctx}", justify="right")
    stride = max(1, -(-len(table.grid) // max_rows))
    shown = sorted(set(range(0, len(table.grid), stride)) | {len(table.grid) - 1})
    for i in shown:
        cells = [f"{table.measured[str(c)][i]:.1f} ±{table.spread[str(c)][i] / 2:.1f}" for c in table.contexts]
        out.add_row(str(table.grid[i]), *cells)
    console.print(out)


FORMATS = ("dspec", "sglang-diagonal", "sglang-additive")


def _profile_steps(name, checkpoint, block_size, requests, verify_tokens, fmt, target, contexts, repeats, warmup,
                   device, dtype, seed, json_path, plot) -> None:
    """``profile-hardware --drafter``: whole steps over requests x verify tokens (dspec_cli.workflows.step_profile)."""
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.core import sglang_sps as sglang_tables
    from dspec_cli.runtime.target import Target
    from dspec_cli.workflows.step_profile import profile_steps

    if block_size < 1:
        raise DspecError(f"--block-size must be >= 1, got {block_size}")
    widths = int_list(verify_tokens, "--verify-tokens") if verify_tokens else (
        [1, block_size // 2 + 1, block_size + 1] if fmt == "sglang-additive" else [block_size + 1])
    tgt = Target.load(target, dtype=dtype, device=device)
    model = load_drafter(name, tgt, checkpoint, block_size)
    rows, ctx = int_list(requests, "--requests"), int_list(contexts, "--contexts")
    err = Console(stderr=True)
    with CommandProgress(err) as bar:
        task = bar.add_task("profiling whole steps", total=len(set(rows)) * len(set(ctx)) * len(set(widths) | {block_size + 1}))

        def advance(c: int, r: int, v: int) -> None:
            bar.update(task, advance=1, description=f"profiling whole steps · context {c} · R={r} · v={v}")

        prof = profile_steps(tgt, model, requests=rows, verify_tokens=widths, contexts=ctx, repeats=repeats,
                             warmup=warmup, model_name=target or "embedded:tiny-target", seed=seed, progress=advance)
    table = prof.cost_table()
    out = Console()
    render_cost_table(table, out if out.is_terminal else Console(width=200))
    if json_path is not None:
        if fmt == "dspec":
            table.save(json_path)
        else:
            sglang_tables.write_json(json_path, sglang_tables.to_sglang_diagonal(table) if fmt == "sglang-diagonal"
                                     else sglang_tables.fit_additive(prof.additive_cells()))
        err.print(f"wrote {json_path}")
    if plot is not None:
        from dspec_cli.workflows.plots import sps_plot

        err.print(f"wrote {sps_plot(table, plot)}")


@app.command("profile-hardware")
def profile_command(
    target: Optional[str] = typer.Option(None, "--target", help="Target model: local path or Hub id (default: the embedded tiny target)."),
    max_batch_tokens: int = typer.Option(256, "--max-batch-tokens", help="Largest B (tokens per forward) profiled."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Explicit B values, e.g. 1,2,4,8 (default: dense 1..16, sparser up to --max-batch-tokens)."),
    contexts: str = typer.Option("128,512,2048", "--contexts", help="Context lengths in the KV cache."),
    row_tokens: int = typer.Option(8, "--row-tokens", help="New tokens per row (γ + 1); B tokens use ceil(B / row-tokens) rows."),
    repeats: int = typer.Option(10, "--repeats", help="Timed forwards per point (median and IQR)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed forwards per point."),
    device: str = typer.Option("cpu", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    seed: int = typer.Option(0, "--seed"),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Time whole speculative steps of this drafter (drafting + verification + host work) over --requests x --verify-tokens."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="With --drafter: its checkpoint (default: the drafter's default)."),
    block_size: int = typer.Option(7, "--block-size", help="With --drafter: γ."),
    requests: str = typer.Option("1,2,4,8,16,32", "--requests", help="With --drafter: concurrent requests R."),
    verify_tokens: Optional[str] = typer.Option(None, "--verify-tokens", help="With --drafter: tokens verified per request, anchor included, 1..γ+1 (default: γ+1; sglang-additive: 1, γ/2+1, γ+1)."),
    fmt: str = typer.Option("dspec", "--format", help="What --json writes: dspec, sglang-diagonal or sglang-additive (the last two need --drafter)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the cost table here (what --cost-table reads)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the SPS(B) curves here."),
) -> None:
    """Profile steps per second SPS(B) of the target (or whole speculative steps) for token-batch sizes B and context lengths."""
    from dspec_cli.core.hardware import default_grid, profile_sps
    from dspec_cli.runtime.target import Target

    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "dspec" and drafter is None:
        raise DspecError(f"--format {fmt} needs --drafter: SGLang's table prices whole DSpark steps (drafting, "
                         "verification, host work); target forwards alone overstate what trimming saves")
    if drafter is not None and grid is not None:
        raise DspecError("--grid sets target-forward batch sizes; with --drafter give --requests and --verify-tokens")
    if drafter is not None:
        return _profile_steps(drafter, checkpoint, block_size, requests, verify_tokens, fmt, target, contexts,
                              repeats, warmup, device, dtype, seed, json_path, plot)

    points = int_list(grid, "--grid") if grid else default_grid(max_batch_tokens)
    ctx = int_list(contexts, "--contexts")
    if repeats < 1:
        raise DspecError(f"--repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise DspecError(f"--warmup must be >= 0, got {warmup}")
    if row_tokens < 1:
        raise DspecError(f"--row-tokens must be >= 1, got {row_tokens}")
    tgt = Target.load(target, dtype=dtype, device=device)
    err = Console(stderr=True)
    with CommandProgress(err) as bar:
        task = bar.add_task("profiling SPS(B)", total=len(set(points)) * len(set(ctx)))

        def advance(c: int, b: int) -> None:
            bar.update(task, advance=1, description=f"profiling SPS(B) · context {c} · B={b}")

        table = profile_sps(tgt.model, grid=points, contexts=ctx, repeats=repeats, warmup=warmup,
                            row_tokens=row_tokens, model_name=target or "embedded:tiny-target", seed=seed,
                            progress=advance)
    out = Console()
    render_cost_table(table, out if out.is_terminal else Console(width=200))
    if json_path is not None:
        table.save(json_path)
        err.print(f"wrote {json_path}")
    if plot is not None:
        from dspec_cli.workflows.plots import sps_plot

        err.print(f"wrote {sps_plot(table, plot)}")
