"""``dspec calibrate``: fit Sequential Temperature Scaling of a drafter's confidences."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.errors import DspecError


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def render_metrics(cal, console: Console) -> None:
    before, after = cal.metrics["before"], cal.metrics["after"]
    table = Table(title=f"calibration of {cal.drafter} (block size {cal.block_size}) · survival Π c_j per position")
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


def _output_dir(checkpoint: str | None, output: Path | None) -> Path:
    if output is not None:
        return output
    if checkpoint and Path(checkpoint).is_dir():
        return Path(checkpoint)
    raise DspecError("give --output DIR: there is no local --checkpoint folder to write calibration.json into")


def _copy_source(checkpoint: str, folder: Path) -> bool:
    """Copy a local checkpoint folder, or a drafter checkpoint from the Hub (not a draft LM from the Hub)."""
    from dspec_cli.checkpoint import read_config

    return Path(checkpoint).is_dir() or (folder / "config.json").is_file() and "drafter" in read_config(folder)


@app.command("calibrate")
def calibrate_command(
    drafter: str = typer.Option(..., "--drafter", "-d", help="Drafter name (see `dspec drafters`)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Drafter checkpoint: folder or Hub id (default: the drafter's default)."),
    dataset: str = typer.Option(..., "--dataset", help="Held-out jsonl prompts ({\"turns\": [...]} lines), a set from `dspec datasets`, or 'builtin'."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use the first N prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    target: Optional[str] = typer.Option(None, "--target", help="Target model: local path or Hub id (default: the embedded tiny target)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="γ (default: the checkpoint's)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature of the runs (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    concurrency: int = typer.Option(8, "--concurrency", help="Concurrent requests while collecting."),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("cpu", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
    output: Optional[Path] = typer.Option(None, "--output", help="Copy the checkpoint here and write calibration.json into the copy."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write ECE/AUROC/Brier before and after as JSON."),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Folder for reliability diagrams (and the sweep) as PNG."),
    sweep_threshold: bool = typer.Option(False, "--sweep-threshold", help="Also report the static-threshold sweep (paper Fig. 5)."),
    save_traces: Optional[Path] = typer.Option(None, "--save-traces", help="Write the recorded rounds (jsonl) for `dspec schedule`."),
) -> None:
    """Record confidences and outcomes on held-out prompts, fit STS, write calibration.json."""
    from dspec_cli import plugins
    from dspec_cli.calibration import (
        CALIBRATION_FILE,
        Calibration,
        apply_temperatures,
        calibrate,
        collect_rounds,
        reliability,
        threshold_sweep,
    )
    from dspec_cli.calibration import save_traces as write_traces
    from dspec_cli.data import load_prompts
    from dspec_cli.engine import GenerationConfig
    from dspec_cli.hub import resolve_checkpoint
    from dspec_cli.target import Target

    if num_prompts is not None and num_prompts < 1:
        raise DspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if block_size is not None and block_size < 1:
        raise DspecError(f"--block-size must be >= 1, got {block_size}")
    cls = plugins.get_drafter_class(drafter)
    out_dir = _output_dir(checkpoint, output)
    ckpt_dir = resolve_checkpoint(checkpoint) if checkpoint else None  # a Hub id -> its cached snapshot
    old_file = ckpt_dir / CALIBRATION_FILE if ckpt_dir else None
    old = Calibration.load(old_file, drafter=cls.name) if old_file and old_file.is_file() else None
    prompts = load_prompts(dataset, num_prompts)
    tgt = Target.load(target, dtype=dtype, device=device)
    overrides = {"block_size": block_size} if block_size is not None else {}
    model = cls.from_pretrained(ckpt_dir, tgt, **overrides) if ckpt_dir else cls.load_default(tgt, **overrides)
    gamma = model.config.block_size
    if old is not None:
        old.check(cls.name, gamma)
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              block_size=gamma, max_batch=concurrency, seed=seed)
    ids = [tgt.render_prompt(p.text) for p in prompts]
    err = Console(stderr=True)
    with CommandProgress(err) as bar:
        task = bar.add_task(f"collecting rounds · {cls.name}", total=len(ids))
        rounds = collect_rounds(tgt, model, ids, config, on_finish=lambda _res: bar.advance(task))
    if old is not None and "confidence" in cls.capabilities:  # the drafter applied the old temperatures: undo
        rounds.confidence = apply_temperatures(rounds.confidence, [1.0 / t for t in old.temperatures])
    cal = calibrate(rounds, cls.name)
    if ckpt_dir is not None and _copy_source(checkpoint, ckpt_dir) and out_dir.resolve() != ckpt_dir.resolve():
        shutil.copytree(ckpt_dir, out_dir, dirs_exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    cal_file = cal.save(out_dir)
    out = Console()
    console = out if out.is_terminal else Console(width=200)
    render_metrics(cal, console)
    err.print(f"wrote {cal_file}")
    sweep = threshold_sweep(rounds) if sweep_threshold else None
    if sweep is not None:
        render_sweep(sweep, console)
    if save_traces is not None:
        save_traces.parent.mkdir(parents=True, exist_ok=True)
        write_traces(save_traces, rounds, drafter=cls.name, block_size=gamma)
        err.print(f"wrote {save_traces}")
    if plots is not None:
        from dspec_cli.plots import reliability_diagram, threshold_sweep_plot

        before = reliability(rounds)
        after = reliability(rounds.with_temperatures(cal.temperatures))
        err.print(f"wrote {reliability_diagram(before, after, plots / 'reliability.png', title=cls.name)}")
        if sweep is not None:
            err.print(f"wrote {threshold_sweep_plot(sweep, plots / 'threshold_sweep.png', title=cls.name)}")
    if json_path is not None:
        before, after = cal.metrics["before"], cal.metrics["after"]
        pick = lambda m: {k: m[k] for k in ("count", "ece", "auroc", "brier", "mean_pred", "mean_label")}  # noqa: E731
        report = {
            "drafter": cls.name, "block_size": gamma, "num_rounds": len(rounds), "calibration_file": str(cal_file),
            "temperatures": cal.temperatures, "ece_before": before["ece_mean"], "ece_after": after["ece_mean"],
            "before": pick(before), "after": pick(after), "threshold_sweep": sweep,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        err.print(f"wrote {json_path}")
