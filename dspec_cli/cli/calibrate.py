"""``dspec calibrate``: fit Sequential Temperature Scaling of a drafter's confidences."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import CommandProgress, results_console
from dspec_cli.core.errors import DspecError
from dspec_cli.core.outputs import (
    check_output_dir,
    check_output_file,
    is_stdout,
    write_json,
)


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


MIN_ROUNDS = 20  # fewer rounds at a position than this: refused unless --force
FEW_ROUNDS = 200  # fewer than this: a warning (the fitted temperature is noisy)


def _plan_output(checkpoint: str | None, output: Path | None, in_place: bool, overwrite: bool) -> Path:
    """Where calibration.json goes, checked before any model loads: a new complete copy in
    ``--output``, or (``--in-place``) the local checkpoint folder itself."""
    local = Path(checkpoint) if checkpoint and Path(checkpoint).is_dir() else None
    if in_place:
        if output is not None:
            raise DspecError("give --output DIR or --in-place, not both")
        if local is None:
            raise DspecError("--in-place needs a local --checkpoint folder (a Hub id or the default drafter has none)")
        check_output_dir(local, "--checkpoint")
        return local
    if output is None:
        where = "" if local is None else f", or --in-place to rewrite {local / 'calibration.json'}"
        raise DspecError(f"give --output DIR for a calibrated copy of the checkpoint{where}")
    if local is not None and output.resolve() == local.resolve():
        raise DspecError("--output is the --checkpoint folder itself; pass --in-place to calibrate it in place")
    check_output_dir(output, "--output")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise DspecError(f"--output {output}: folder is not empty; pass --overwrite to replace it")
    return output


def _write_copy(model, source: Path | None, cal, out_dir: Path) -> Path:
    """A complete checkpoint in ``out_dir`` (the source folder's files, else the loaded drafter
    saved) with the new calibration.json; staged and renamed, so an interruption leaves no half copy."""
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if source is not None:
            shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".cache", ".git*"))
        else:
            model.save_pretrained(staging)
        name = cal.save(staging).name
        if out_dir.exists():  # --overwrite
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old)
        else:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir / name


def _check_rounds(counts: list[int], force: bool) -> None:
    """Refuse a fit resting on fewer than MIN_ROUNDS rounds at some position (unless --force); warn below FEW_ROUNDS."""
    k = min(range(len(counts)), key=counts.__getitem__)
    hint = "use more prompts (--dataset, --num-prompts) or a larger --max-new-tokens"
    if counts[k] < MIN_ROUNDS and not force:
        raise DspecError(f"only {counts[k]} rounds reached position {k + 1} (at least {MIN_ROUNDS} needed, "
                         f"{FEW_ROUNDS} recommended): {hint}, or pass --force")
    if counts[k] < FEW_ROUNDS:
        warnings.warn(f"only {counts[k]} rounds reached position {k + 1}; its temperature is noisy "
                      f"({FEW_ROUNDS} rounds recommended): {hint}", stacklevel=1)


@app.command("calibrate")
def calibrate_command(
    drafter: str = typer.Option(..., "--drafter", "-d", help="Drafter name (see `dspec drafters`); it needs a confidence signal (a confidence head or draft probabilities)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", metavar="PATH|HUB_ID", help="Drafter checkpoint: folder or Hub id (default: the drafter's default)."),
    dataset: list[str] = opt.dataset(),
    traces: Optional[Path] = typer.Option(None, "--traces", help="Fit on recorded rounds instead of running the drafter: jsonl from --save-traces, or SGLang STS shards (SGLANG_DSPARK_STS_COLLECT_PATH's stem, or one .pt)."),
    sglang_sts: Optional[Path] = typer.Option(None, "--sglang-sts", help="Also write the temperatures as SGLang's STS file (--speculative-dspark-confidence-sts-path)."),
    num_prompts: Optional[int] = opt.num_prompts(),
    max_new_tokens: int = opt.max_new_tokens(128),
    target: Optional[str] = opt.target(),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="γ, >= 1 and at most the trained block (default: the checkpoint's)."),
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
    force: bool = typer.Option(False, "--force", help=f"Fit even when a position rests on fewer than {MIN_ROUNDS} rounds."),
    strict: bool = opt.strict("a prompt that does not fit the target's context"),
    json_path: Optional[Path] = opt.json_path("ECE/AUROC/Brier before and after"),
    plots: Optional[Path] = opt.plots("reliability.png (and threshold_sweep.png with --sweep-threshold)"),
    sweep_threshold: bool = typer.Option(False, "--sweep-threshold", help="Also report the static-threshold sweep (paper Fig. 5)."),
    save_traces: Optional[Path] = typer.Option(None, "--save-traces", metavar="FILE", help="Write the recorded rounds (jsonl) for `dspec schedule`."),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(),
) -> None:
    """Record confidences and outcomes on held-out prompts (or read recorded ones), fit STS, write calibration.json."""
    from dspec_cli.checkpoints.hub import resolve_checkpoint
    from dspec_cli.checkpoints.native import choose_target
    from dspec_cli.core import plugins
    from dspec_cli.core.calibration import Calibration
    from dspec_cli.core.data import BUILTIN, load_prompts
    from dspec_cli.core.devices import parse_dtype, resolve_device
    from dspec_cli.core.files import CALIBRATION_FILE, embedded_path
    from dspec_cli.runtime.engine import GenerationConfig
    from dspec_cli.runtime.target import Target
    from dspec_cli.workflows.calibrate import (
        calibrate,
        record_rounds,
        reliability,
        threshold_sweep,
    )
    from dspec_cli.workflows.calibrate import save_traces as write_traces
    from dspec_cli.workflows.sglang_sts import load_rounds, sts_dict

    if num_prompts is not None and num_prompts < 1:
        raise DspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if block_size is not None and block_size < 1:
        raise DspecError(f"--block-size must be >= 1, got {block_size}")
    cls = plugins.get_drafter_class(drafter)
    if not {"confidence", "draft_probs"} & set(cls.capabilities):
        raise DspecError(f"drafter {cls.name!r} has no confidence signal (no confidence head, no draft "
                         "probabilities): its confidences are constant, so there is nothing to calibrate")
    if traces is not None and dataset:
        raise DspecError("give --dataset (run the drafter) or --traces (recorded rounds), not both")
    template_kwargs = opt.template_kwargs(chat_template_kwargs)
    GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                     max_batch=concurrency)  # sampling options checked up front
    resolve_device(device), parse_dtype(dtype)
    sts_only = traces is not None and sglang_sts is not None and output is None and not in_place
    out_dir = None if sts_only else _plan_output(checkpoint, output, in_place, overwrite)
    check_output_file(json_path, "--json")
    check_output_file(sglang_sts, "--sglang-sts")
    check_output_dir(plots, "--plots")
    check_output_file(save_traces, "--save-traces", overwrite=overwrite)
    ckpt_dir = resolve_checkpoint(checkpoint) if checkpoint else None  # a Hub id -> its cached snapshot
    old_file = ckpt_dir / CALIBRATION_FILE if ckpt_dir else None
    old = Calibration.load(old_file, drafter=cls.name) if old_file and old_file.is_file() else None
    err = Console(stderr=True)
    model, skipped, used = None, 0, 0
    if traces is not None:  # raw confidences as recorded (SGLang records the head's output before STS)
        rounds, meta = load_rounds(traces, block_size)
        if meta["drafter"] and meta["drafter"] != cls.name:
            raise DspecError(f"traces {traces} are of drafter {meta['drafter']!r}, not {cls.name!r}")
        gamma = rounds.block_size
        if out_dir is not None and ckpt_dir is None:  # the default drafter's checkpoint is the embedded one
            ckpt_dir = embedded_path("drafters") / cls.name
            if not (ckpt_dir / "config.json").is_file():
                raise DspecError(f"with --traces, --output needs the --checkpoint the traces belong to "
                                 f"(no {cls.name} drafter is embedded)")
    else:
        prompts = [p for d in (dataset or [BUILTIN]) for p in load_prompts(d, num_prompts)]
        target = choose_target(target, [ckpt_dir])  # no --target: the one the checkpoint was trained for
        tgt = Target.load(target, dtype=dtype, device=device)
        overrides = {"block_size": block_size} if block_size is not None else {}
        model = cls.from_pretrained(ckpt_dir, tgt, **overrides) if ckpt_dir else cls.load_default(tgt, **overrides)
        gamma = model.config.block_size
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  block_size=gamma, max_batch=concurrency, seed=seed)
        with CommandProgress(err, unit="prompts") as bar:

            def progress(total: int):
                task = bar.add_task(f"collecting rounds · {cls.name}", total=total)
                return lambda _res: bar.advance(task)

            rounds, used, skipped = record_rounds(tgt, model, [p.text for p in prompts], config, strict=strict,
                                                  progress=progress, chat_template_kwargs=template_kwargs)
        if skipped:
            warnings.warn(f"skipped {skipped} of {len(prompts)} prompt(s) that do not fit the target's context with "
                          f"--max-new-tokens {max_new_tokens} (--strict makes this an error)", stacklevel=1)
    if old is not None:
        old.check(cls.name, gamma)
    cal = calibrate(rounds, cls.name)
    _check_rounds(cal.metrics["before"]["count"], force)
    if sglang_sts is not None:
        opt.wrote(err, write_json(sglang_sts, sts_dict(cal, dataset=str(traces or ",".join(dataset) or BUILTIN),
                                                      num_samples=len(rounds))))
    cal_file = None
    if out_dir is not None:
        cal_file = cal.save(out_dir) if in_place else _write_copy(model, ckpt_dir, cal, out_dir)
    console = results_console()
    if not is_stdout(json_path):
        render_metrics(cal, console, f"{used} prompts" + (f" ({skipped} skipped: too long)" if skipped else ""))
    opt.wrote(err, cal_file)
    sweep = threshold_sweep(rounds) if sweep_threshold else None
    if sweep is not None and not is_stdout(json_path):
        render_sweep(sweep, console)
    if save_traces is not None:
        write_traces(save_traces, rounds, drafter=cls.name, block_size=gamma)
        opt.wrote(err, save_traces)
    if plots is not None:
        from dspec_cli.workflows.plots import reliability_diagram, threshold_sweep_plot

        title = f"{cls.name} · {target or 'embedded:tiny-target'} · {tgt.device} · temperature {temperature:g}"
        before = reliability(rounds)
        after = reliability(rounds.with_temperatures(cal.temperatures))
        opt.wrote(err, reliability_diagram(before, after, plots / "reliability.png", title=title))
        if sweep is not None:
            opt.wrote(err, threshold_sweep_plot(sweep, plots / "threshold_sweep.png", title=title))
    if json_path is not None:
        before, after = cal.metrics["before"], cal.metrics["after"]
        pick = lambda m: {k: m[k] for k in ("count", "ece", "auroc", "brier", "mean_pred", "mean_label")}  # noqa: E731
        report = {
            "drafter": cls.name, "block_size": gamma, "num_rounds": len(rounds), "num_prompts": used,
            "skipped_prompts": skipped, "calibration_file": str(cal_file) if cal_file else None,
            "temperatures": cal.temperatures, "ece_before": before["ece_mean"], "ece_after": after["ece_mean"],
            "before": pick(before), "after": pick(after), "threshold_sweep": sweep,
        }
        opt.wrote(err, write_json(json_path, report))
