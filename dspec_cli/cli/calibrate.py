"""``dspec calibrate``: fit Sequential Temperature Scaling of a drafter's confidences."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import CommandProgress, results_console
from dspec_cli.core.files import CALIBRATION_FILE, CHECKPOINT_READS
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths

PLOTS = ("reliability.png", "threshold_sweep.png")


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def render_metrics(cal, console: Console, caption: str = "") -> None:
    before, after = cal.metrics["before"], cal.metrics["after"]
    table = Table(title=f"calibration of {cal.drafter} (block size {cal.block_size}) · survival Π c_j per position",
                  caption=caption or None)
    for col in ("pos", "rounds", "T_k", "ECE before", "ECE after", "AUROC before", "AUROC after", "Brier before",
                "Brier after"):
        table.add_column(col, justify="right")
    for k in range(cal.block_size):
        table.add_row(
            str(k + 1), str(before["count"][k]), f"{cal.temperatures[k]:.3g}",
            _f(before["ece"][k]), _f(after["ece"][k]), _f(before["auroc"][k]), _f(after["auroc"][k]),
            _f(before["brier"][k]), _f(after["brier"][k]),
        )
    table.add_row("all", str(sum(before["count"])), "", _f(before["ece_mean"]), _f(after["ece_mean"]), "", "",
                  _f(before["brier_mean"]), _f(after["brier_mean"]), style="bold")
    console.print(table)


def render_sweep(sweep: list[dict], console: Console) -> None:
    table = Table(title="static threshold sweep (cut at the first c_k < t)")
    for col in ("threshold", "verified/step", "accepted/step", "rejected/step", "acceptance rate"):
        table.add_column(col, justify="right")
    for row in sweep:
        rate = row["acceptance_rate"]
        table.add_row(f"{row['threshold']:.1f}", f"{row['verified_per_step']:.2f}", f"{row['accepted_per_step']:.2f}",
                      f"{row['rejected_per_step']:.2f}", "-" if rate is None else f"{100 * rate:.1f}%")
    console.print(table)


@app.command("calibrate")
def calibrate_command(
    ctx: typer.Context,
    drafter: str = typer.Option(..., "--drafter", "-d", help="Drafter: NAME[,KEY=VALUE...] with config options (see `dspec drafters`); it needs a confidence signal (a confidence head or draft probabilities)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", metavar="PATH|HUB_ID", help="Drafter checkpoint: folder or Hub id (default: the drafter's default)."),
    dataset: list[str] = opt.dataset(),
    traces: Optional[Path] = typer.Option(None, "--traces", help="Fit on recorded rounds instead of running the drafter: jsonl from --save-traces, or SGLang STS shards (SGLANG_DSPARK_STS_COLLECT_PATH's stem, or one .pt)."),
    sglang_sts: Optional[Path] = typer.Option(None, "--sglang-sts", help="Also write the temperatures as SGLang's STS file (--speculative-dspark-confidence-sts-path)."),
    num_prompts: Optional[int] = opt.num_prompts(),
    max_new_tokens: int = opt.max_new_tokens(128),
    target: Optional[str] = opt.target(),
    block_size: Optional[int] = opt.block_size(None, "γ, >= 1 and at most the trained block (default: the checkpoint's)."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    concurrency: int = opt.concurrency(8),
    seed: int = opt.seed(),
    device: str = opt.device(),
    dtype: str = opt.dtype(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="DIR", help="Write a complete calibrated copy of the checkpoint here."),
    in_place: bool = typer.Option(False, "--in-place", help="Rewrite calibration.json in the local --checkpoint folder instead."),
    overwrite: bool = opt.overwrite("a non-empty --output folder or an existing --save-traces file"),
    force: bool = typer.Option(False, "--force", help="Fit even when a position rests on fewer rounds than a usable temperature needs (the error says how many)."),
    strict: bool = opt.strict("a prompt that does not fit the target's context"),
    json_path: Optional[Path] = opt.json_path("ECE/AUROC/Brier before and after"),
    plots: Optional[Path] = opt.plots("reliability.png (and threshold_sweep.png with --sweep-threshold)"),
    sweep_threshold: bool = typer.Option(False, "--sweep-threshold", help="Also report the static-threshold sweep (paper Fig. 5)."),
    save_traces: Optional[Path] = typer.Option(None, "--save-traces", metavar="FILE", help="Write the recorded rounds (jsonl) for `dspec schedule`."),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(),
) -> None:
    """Record confidences and outcomes on held-out prompts (or read recorded ones), fit STS, write calibration.json."""
    from dspec_cli.workflows.calibrate_run import CalibrateOptions, run_calibrate

    if traces is not None:  # recorded rounds: nothing runs
        opt.refuse(ctx, ("num_prompts", "max_new_tokens", "temperature", "top_p", "top_k", "concurrency", "seed", "target",
                         "device", "dtype", "strict", "chat_template_kwargs"), "with --traces (recorded rounds)",
                   "when the drafter runs")
    paths = RunPaths().read("--dataset", *dataset).read("--traces", *opt.trace_files(traces)).read("--target", target)
    if in_place and checkpoint and Path(checkpoint).is_dir():  # its calibration.json is the output
        paths.read("--checkpoint", checkpoint, names=[n for n in CHECKPOINT_READS if n != CALIBRATION_FILE])
        paths.write("--in-place", Path(checkpoint) / CALIBRATION_FILE)
    else:
        paths.read("--checkpoint", checkpoint, names=CHECKPOINT_READS, hint="pass --in-place to calibrate it in place")
    paths.write_folder("--output", output, overwrite=overwrite).write("--sglang-sts", sglang_sts, stream=True) \
        .write_folder("--plots", plots, files=PLOTS).write("--save-traces", save_traces, stream=True, overwrite=overwrite) \
        .write("--json", json_path, stream=True).check()
    opts = CalibrateOptions(
        drafter=drafter, checkpoint=checkpoint, datasets=dataset, traces=traces, sglang_sts=sglang_sts,
        num_prompts=num_prompts, max_new_tokens=max_new_tokens, target=target, block_size=block_size,
        temperature=temperature, top_p=top_p, top_k=top_k, concurrency=concurrency, seed=seed, device=device,
        dtype=dtype, output=output, in_place=in_place, overwrite=overwrite, force=force, strict=strict, plots=plots,
        sweep_threshold=sweep_threshold, save_traces=save_traces,
        chat_template_kwargs=opt.template_kwargs(chat_template_kwargs),
    )
    err = Console(stderr=True)
    with CommandProgress(err, unit="prompts") as bar:

        def progress(desc: str, total: int):
            task = bar.add_task(desc, total=total)
            return lambda _res: bar.advance(task)

        result = run_calibrate(opts, progress)
    if not any(is_stdout(p) for p in (json_path, save_traces, sglang_sts)):  # stdout holds the streamed output only
        console = results_console()
        skipped = f" ({result.skipped} skipped: too long)" if result.skipped else ""
        render_metrics(result.calibration, console, f"{result.used} prompts{skipped}")
        if result.sweep is not None:
            render_sweep(result.sweep, console)
    for path in result.written:
        opt.wrote(err, path)
    if json_path is not None:
        opt.wrote(err, write_json(json_path, result.report()))
