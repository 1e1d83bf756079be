"""``dspec profile-hardware``: measure SPS(B) of the target forward the engine runs and write the cost table."""

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
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CHECKPOINT_READS
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.records import MAX_TOKENS
from dspec_cli.core.run_paths import RunPaths

DEFAULT_CONTEXTS = (128, 512, 2048)


def fit_contexts(contexts: list[int], max_ctx: int | None, row_tokens: int) -> list[int]:
    """Contexts clipped to what fits the target with ``row_tokens`` new tokens after them."""
    if not max_ctx:
        return contexts
    return sorted({min(c, max_ctx - row_tokens) for c in contexts})


def _default_contexts(contexts: list[int], target, tokens_after: int) -> list[int]:
    """The default contexts clipped to the target's, with a warning naming the ones used."""
    max_ctx = target.max_context
    fitted = fit_contexts(contexts, max_ctx, tokens_after)
    if fitted != contexts:
        warnings.warn(f"the target's context is {max_ctx} tokens: profiling contexts {','.join(map(str, fitted))} "
                      f"(the default {','.join(map(str, contexts))} clipped)", stacklevel=1)
    return fitted


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
                   device, dtype, seed, json_path, plots, cuda_graphs, batch_invariant) -> None:
    """``profile-hardware --drafter``: whole steps over requests x verify tokens (dspec_cli.workflows.step_profile)."""
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.checkpoints.hub import resolve_checkpoint
    from dspec_cli.checkpoints.native import choose_target
    from dspec_cli.core import sglang_sps as sglang_tables
    from dspec_cli.runtime.target import Target
    from dspec_cli.workflows.step_profile import profile_steps, tokens_after_context

    widths = int_list(verify_tokens, "--verify-tokens", maximum=block_size + 1) if verify_tokens else (
        [1, block_size // 2 + 1, block_size + 1] if fmt == "sglang-additive" else [block_size + 1])
    path = str(resolve_checkpoint(checkpoint)) if checkpoint else None
    target = choose_target(target, [path])  # no --target: the one the checkpoint was trained for
    rows = int_list(requests, "--requests", maximum=opt.MAX_CONCURRENCY)
    ctx: list[int] = int_list(contexts, "--contexts", maximum=MAX_TOKENS) if contexts else list(DEFAULT_CONTEXTS)
    tgt = Target.load(target, dtype=dtype, device=device)
    if contexts is None:
        ctx = _default_contexts(ctx, tgt, tokens_after_context(block_size, repeats, warmup))
    model = load_drafter(name, tgt, path, block_size)
    err = Console(stderr=True)
    with CommandProgress(err, unit="cells") as bar:
        total = len(set(rows)) * len(set(ctx)) * len(set(widths) | {block_size + 1})
        task = bar.add_task("profiling whole steps", total=total)

        def advance(c: int, r: int, v: int) -> None:
            bar.update(task, advance=1, description=f"profiling whole steps · context {c} · R={r} · v={v}")

        prof = profile_steps(tgt, model, requests=rows, verify_tokens=widths, contexts=ctx, repeats=repeats,
                             warmup=warmup, model_name=target or "embedded:tiny-target", seed=seed, progress=advance,
                             graphs="auto" if cuda_graphs else "eager", batch_invariant=batch_invariant)
        bar.update(task, completed=total)  # a tree drafter has one width: fewer cells than asked
    table = prof.cost_table()
    if not is_stdout(json_path):
        render_cost_table(table, results_console())
    if json_path is not None:
        if fmt == "dspec":
            table.save(json_path)
        else:
            write_json(json_path, sglang_tables.to_sglang_diagonal(table) if fmt == "sglang-diagonal"
                                     else sglang_tables.fit_additive(prof.additive_cells()))
        opt.wrote(err, None if is_stdout(json_path) else json_path)
    if plots is not None:
        from dspec_cli.workflows.plots import sps_plot

        opt.wrote(err, sps_plot(table, plots / "sps.png"))


@app.command("profile-hardware")
def profile_command(
    ctx: typer.Context,
    target: Optional[str] = opt.target(),
    max_batch_tokens: int = opt.int_option(256, "--max-batch-tokens", minimum=1, maximum=MAX_TOKENS, help="Largest B (tokens per forward) profiled, >= 1."),
    grid: Optional[str] = typer.Option(None, "--grid", metavar="B[,B...]", help="Explicit B values, e.g. 1,2,4,8 (default: dense 1..16, sparser up to --max-batch-tokens)."),
    contexts: Optional[str] = typer.Option(None, "--contexts", metavar="C[,C...]", help="Context lengths in the KV cache, >= 1 (default 128,512,2048, clipped to the target's context)."),
    row_tokens: int = opt.int_option(8, "--row-tokens", minimum=1, maximum=MAX_TOKENS, help="New tokens per row (γ + 1), >= 1; B tokens use ceil(B / row-tokens) rows."),
    repeats: int = opt.int_option(10, "--repeats", minimum=1, maximum=1_000_000, help="Timed forwards per point (median and IQR), >= 1."),
    warmup: int = opt.int_option(2, "--warmup", minimum=0, maximum=1_000_000, help="Untimed forwards per point, >= 0."),
    device: str = opt.device(),
    dtype: str = opt.dtype(),
    cuda_graphs: bool = opt.cuda_graphs(),
    batch_invariant: Optional[bool] = opt.batch_invariant(),
    seed: int = opt.seed(),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Time whole speculative steps of this drafter (drafting + verification + host work) over --requests x --verify-tokens."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="With --drafter: its checkpoint (default: the drafter's default)."),
    block_size: int = opt.block_size(7, "With --drafter: γ."),
    requests: str = typer.Option("1,2,4,8,16,32", "--requests", help="With --drafter: concurrent requests R."),
    verify_tokens: Optional[str] = typer.Option(None, "--verify-tokens", help="With --drafter: tokens verified per request, anchor included, 1..γ+1 (default: γ+1; sglang-additive: 1, γ/2+1, γ+1)."),
    fmt: str = typer.Option("dspec", "--format", help="What --json writes: dspec, sglang-diagonal or sglang-additive (the last two need --drafter)."),
    json_path: Optional[Path] = opt.json_path("the cost table (what --cost-table reads)"),
    plots: Optional[Path] = opt.plots("sps.png, the SPS(B) curves"),
) -> None:
    """Profile steps per second SPS(B) of the target (or whole speculative steps) for token-batch sizes B and context lengths."""
    from dspec_cli.core.devices import parse_dtype, resolve_device
    from dspec_cli.core.hardware import default_grid
    from dspec_cli.runtime.target import Target
    from dspec_cli.workflows.target_profile import profile_target

    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "dspec" and drafter is None:
        raise DspecError(f"--format {fmt} needs --drafter: SGLang's table prices whole DSpark steps (drafting, "
                         "verification, host work); target forwards alone overstate what trimming saves")
    if drafter is not None and grid is not None:
        raise DspecError("--grid sets target-forward batch sizes; with --drafter give --requests and --verify-tokens")
    if drafter is None:
        opt.refuse(ctx, ("checkpoint", "block_size", "requests", "verify_tokens"), "without --drafter", "with --drafter")
    else:
        opt.refuse(ctx, ("max_batch_tokens", "row_tokens"), "with --drafter",
                   "to target forwards (with --drafter give --requests and --verify-tokens)")
    RunPaths().read("--target", target).read("--checkpoint", checkpoint, names=CHECKPOINT_READS) \
        .write("--json", json_path, stream=True).write_folder("--plots", plots, files=("sps.png",)).check()
    if drafter is not None:
        resolve_device(device)
        parse_dtype(dtype)
        return _profile_steps(drafter, checkpoint, block_size, requests, verify_tokens, fmt, target, contexts,
                              repeats, warmup, device, dtype, seed, json_path, plots, cuda_graphs, batch_invariant)

    points = int_list(grid, "--grid", maximum=MAX_TOKENS) if grid else default_grid(max_batch_tokens)
    lengths: list[int] = int_list(contexts, "--contexts", maximum=MAX_TOKENS) if contexts else list(DEFAULT_CONTEXTS)
    resolve_device(device)
    parse_dtype(dtype)
    tgt = Target.load(target, dtype=dtype, device=device)
    err = Console(stderr=True)
    if contexts is None:
        lengths = _default_contexts(lengths, tgt, row_tokens)
    with CommandProgress(err, unit="points") as bar:
        task = bar.add_task("profiling SPS(B)", total=len(set(points)) * len(set(lengths)))

        def advance(c: int, b: int) -> None:
            bar.update(task, advance=1, description=f"profiling SPS(B) · context {c} · B={b}")

        table = profile_target(tgt, grid=points, contexts=lengths, repeats=repeats, warmup=warmup,
                               row_tokens=row_tokens, model_name=target or "embedded:tiny-target", seed=seed,
                               cuda_graphs=cuda_graphs, batch_invariant=batch_invariant, progress=advance)
    if not is_stdout(json_path):
        render_cost_table(table, results_console())
    if json_path is not None:
        table.save(json_path)
        opt.wrote(err, None if is_stdout(json_path) else json_path)
    if plots is not None:
        from dspec_cli.workflows.plots import sps_plot

        opt.wrote(err, sps_plot(table, plots / "sps.png"))
