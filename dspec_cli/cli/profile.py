"""``dspec profile-hardware``: measure SPS(B) of the target forward and write the cost table."""

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
from dspec_cli.cli.progress import CommandProgress, results_console
from dspec_cli.errors import DspecError
from dspec_cli.outputs import check_output_dir, check_output_file, is_stdout


DEFAULT_CONTEXTS = (128, 512, 2048)


def fit_contexts(contexts: list[int], max_ctx: int | None, row_tokens: int) -> list[int]:
    """Contexts clipped to what fits the target with ``row_tokens`` new tokens after them."""
    if not max_ctx:
        return contexts
    return sorted({min(c, max_ctx - row_tokens) for c in contexts})


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


@app.command("profile-hardware")
def profile_command(
    target: Optional[str] = opt.target(),
    max_batch_tokens: int = typer.Option(256, "--max-batch-tokens", help="Largest B (tokens per forward) profiled, >= 1."),
    grid: Optional[str] = typer.Option(None, "--grid", metavar="B[,B...]", help="Explicit B values, e.g. 1,2,4,8 (default: dense 1..16, sparser up to --max-batch-tokens)."),
    contexts: Optional[str] = typer.Option(None, "--contexts", metavar="C[,C...]", help="Context lengths in the KV cache, >= 1 (default 128,512,2048, clipped to the target's context)."),
    row_tokens: int = typer.Option(8, "--row-tokens", help="New tokens per row (γ + 1), >= 1; B tokens use ceil(B / row-tokens) rows."),
    repeats: int = typer.Option(10, "--repeats", help="Timed forwards per point (median and IQR), >= 1."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed forwards per point, >= 0."),
    device: str = opt.device(),
    dtype: str = opt.dtype(),
    seed: int = opt.seed(),
    json_path: Optional[Path] = opt.json_path("the cost table (what --cost-table reads)"),
    plots: Optional[Path] = opt.plots("sps.png, the SPS(B) curves"),
) -> None:
    """Profile steps per second SPS(B) of the target for token-batch sizes B and context lengths."""
    from dspec_cli.hardware import default_grid, profile_sps
    from dspec_cli.devices import parse_dtype, resolve_device
    from dspec_cli.target import Target

    points = int_list(grid, "--grid") if grid else default_grid(max_batch_tokens)
    ctx = int_list(contexts, "--contexts") if contexts else list(DEFAULT_CONTEXTS)
    if repeats < 1:
        raise DspecError(f"--repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise DspecError(f"--warmup must be >= 0, got {warmup}")
    if row_tokens < 1:
        raise DspecError(f"--row-tokens must be >= 1, got {row_tokens}")
    check_output_file(json_path, "--json")
    check_output_dir(plots, "--plots")
    resolve_device(device), parse_dtype(dtype)
    tgt = Target.load(target, dtype=dtype, device=device)
    err = Console(stderr=True)
    if contexts is None:
        max_ctx = getattr(tgt.model.config.get_text_config(), "max_position_embeddings", None)
        fitted = fit_contexts(ctx, max_ctx, row_tokens)
        if fitted != ctx:
            warnings.warn(f"the target's context is {max_ctx} tokens: profiling contexts {','.join(map(str, fitted))} "
                          f"(the default {','.join(map(str, ctx))} clipped)", stacklevel=1)
        ctx = fitted
    with CommandProgress(err, unit="points") as bar:
        task = bar.add_task("profiling SPS(B)", total=len(set(points)) * len(set(ctx)))

        def advance(c: int, b: int) -> None:
            bar.update(task, advance=1, description=f"profiling SPS(B) · context {c} · B={b}")

        table = profile_sps(tgt.model, grid=points, contexts=ctx, repeats=repeats, warmup=warmup,
                            row_tokens=row_tokens, model_name=target or "embedded:tiny-target", seed=seed,
                            progress=advance)
    if not is_stdout(json_path):
        render_cost_table(table, results_console())
    if json_path is not None:
        table.save(json_path)
        opt.wrote(err, None if is_stdout(json_path) else json_path)
    if plots is not None:
        from dspec_cli.plots import sps_plot

        opt.wrote(err, sps_plot(table, plots / "sps.png"))
