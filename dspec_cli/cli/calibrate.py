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

PLOTS = ("reliability.png", "threshold_sweep.png", "reliability-*.png", "threshold_sweep-*.png")  # -RULE: several rules


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def render_metrics(result, console: Console, caption: str = "") -> None:
    """One table per verification rule: raw, STS and survival-map ECE in-sample and held-out
    (or, for an evaluation, on the rounds given), AUROC and Brier of what dspec applies."""
    cal = result.calibration
    for rule in result.rounds:
        m, fit = result.metrics[rule], cal.fit(rule)
        held = m.get("heldout")
        what = "evaluated on these rounds" if result.evaluated else f"held-out: {held['split']}" if held else ""
        floor = f" · ECE of perfect calibration on this many rounds ≈ {m['floor']:.3f}" if m.get("floor") is not None else ""
        table = Table(title=f"calibration of {cal.drafter} (block size {cal.block_size}) · {rule} rule · "
                            f"survival per position · {what}", caption=(caption + floor) or None)
        cols = ["pos", "rounds", "T_k", "slope", "offset", "ECE raw", "ECE STS", "ECE fit"]
        cols += ["ECE STS held-out", "ECE fit held-out"] if held else []
        for col in (*cols, "AUROC", "Brier"):
            table.add_column(col, justify="right")
        keys = ("before", "sts", "after")
        for k in range(cal.block_size):
            surv = ("-", "-") if fit.slope is None or fit.offset is None else (f"{fit.slope[k]:.3g}", f"{fit.offset[k]:.3g}")
            row = [str(k + 1), str(m["before"]["count"][k]), f"{fit.temperatures[k]:.3g}", *surv]
            row += [_f(m[key]["ece"][k]) for key in keys]
            row += [_f(held["sts"]["ece"][k]), _f(held["after"]["ece"][k])] if held else []
            table.add_row(*row, _f(m["after"]["auroc"][k]), _f(m["after"]["brier"][k]))
        total = ["all", str(sum(m["before"]["count"])), "", "", "", *(_f(m[key]["ece_mean"]) for key in keys)]
        total += [_f(held["sts"]["ece_mean"]), _f(held["after"]["ece_mean"])] if held else []
        table.add_row(*total, "", _f(m["after"]["brier_mean"]), style="bold")
        console.print(table)


def render_sweep(sweep: list[dict], console: Console, rule: str) -> None:
    table = Table(title=f"static threshold sweep (cut at the first raw c_k < t) · {rule} rule")
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
    sglang_sts: Optional[Path] = typer.Option(None, "--sglang-sts", help="Also write the token rule's temperatures as SGLang's STS file (--speculative-dspark-confidence-sts-path)."),
    verify: list[str] = typer.Option([], "--verify", help="Verification rule to fit, token or block (repeatable: one run and fit each; default: the rule `dspec bench` verifies by, block). calibration.json keeps the checkpoint's fits for other rules."),
    evaluate: bool = typer.Option(False, "--evaluate", help="Score the checkpoint's calibration on these rounds (prompts it was not fitted on) instead of fitting; writes no calibration."),
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
    batch_invariant: Optional[bool] = opt.batch_invariant(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="DIR", help="Write a complete calibrated copy of the checkpoint here."),
    in_place: bool = typer.Option(False, "--in-place", help="Rewrite calibration.json in the local --checkpoint folder instead."),
    overwrite: bool = opt.overwrite("a non-empty --output folder or an existing --save-traces file"),
    force: bool = typer.Option(False, "--force", help="Fit even when a position rests on fewer rounds than a usable temperature needs (the error says how many)."),
    strict: bool = opt.strict("a prompt that does not fit the target's context"),
    json_path: Optional[Path] = opt.json_path("per rule: ECE/AUROC/Brier raw, STS and fitted, in-sample and held-out"),
    plots: Optional[Path] = opt.plots("reliability.png (and threshold_sweep.png with --sweep-threshold)"),
    sweep_threshold: bool = typer.Option(False, "--sweep-threshold", help="Also report the static-threshold sweep (paper Fig. 5)."),
    save_traces: Optional[Path] = typer.Option(None, "--save-traces", metavar="FILE", help="Write the recorded rounds (jsonl) for `dspec schedule` (with several --verify rules: FILE's stem + '-RULE' per rule)."),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(),
) -> None:
    """Record confidences and outcomes on held-out prompts (or read recorded ones) under a verification rule, fit STS and the survival map, write calibration.json."""
    from dspec_cli.workflows.calibrate_run import (
        CalibrateOptions,
        run_calibrate,
        traces_outputs,
    )

    if traces is not None:  # recorded rounds: nothing runs
        opt.refuse(ctx, ("num_prompts", "max_new_tokens", "temperature", "top_p", "top_k", "concurrency", "seed", "target",
                         "device", "dtype", "batch_invariant", "strict", "chat_template_kwargs"), "with --traces (recorded rounds)",
                   "when the drafter runs")
    opts = CalibrateOptions(
        drafter=drafter, checkpoint=checkpoint, datasets=dataset, traces=traces, sglang_sts=sglang_sts, verify=verify,
        evaluate=evaluate,
        num_prompts=num_prompts, max_new_tokens=max_new_tokens, target=target, block_size=block_size,
        temperature=temperature, top_p=top_p, top_k=top_k, concurrency=concurrency, seed=seed, device=device,
        dtype=dtype, batch_invariant=batch_invariant, output=output, in_place=in_place, overwrite=overwrite, force=force,
        strict=strict, plots=plots, sweep_threshold=sweep_threshold, save_traces=save_traces,
        chat_template_kwargs=opt.template_kwargs(chat_template_kwargs),
    )
    paths = RunPaths().read("--dataset", *dataset).read("--traces", *opt.trace_files(traces)).read("--target", target)
    if in_place and checkpoint and Path(checkpoint).is_dir():  # its calibration.json is the output
        paths.read("--checkpoint", checkpoint, names=[n for n in CHECKPOINT_READS if n != CALIBRATION_FILE])
        paths.write("--in-place", Path(checkpoint) / CALIBRATION_FILE)
    else:
        paths.read("--checkpoint", checkpoint, names=CHECKPOINT_READS, hint="pass --in-place to calibrate it in place")
    paths.write_folder("--output", output, overwrite=overwrite).write("--sglang-sts", sglang_sts, stream=True) \
        .write_folder("--plots", plots, files=PLOTS).write("--json", json_path, stream=True)
    for path in traces_outputs(opts):  # one file per --verify rule when there are several
        paths.write("--save-traces", path, stream=True, overwrite=overwrite)
    paths.check()
    err = Console(stderr=True)
    with CommandProgress(err, unit="prompts") as bar:

        def progress(desc: str, total: int):
            task = bar.add_task(desc, total=total)
            return lambda _res: bar.advance(task)

        result = run_calibrate(opts, progress)
    if not any(is_stdout(p) for p in (json_path, save_traces, sglang_sts)):  # stdout holds the streamed output only
        console = results_console()
        skipped = f" ({result.skipped} skipped: too long)" if result.skipped else ""
        kept = f" · kept the earlier {' and '.join(result.kept)} rule fit" if result.kept else ""
        render_metrics(result, console, f"{result.used} prompts{skipped}{kept}")
        for rule, sweep in (result.sweep or {}).items():
            render_sweep(sweep, console, rule)
    for path in result.written:
        opt.wrote(err, path)
    if json_path is not None:
        opt.wrote(err, write_json(json_path, result.report()))
