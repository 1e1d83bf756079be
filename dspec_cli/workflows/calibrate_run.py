"""``dspec calibrate``: record a drafter's rounds (or read recorded ones), fit STS, write
``calibration.json`` and the side outputs; the fitting itself is :mod:`~dspec_cli.workflows.calibrate`."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dspec_cli.checkpoints import load_drafter
from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.checkpoints.native import choose_target
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.chat_template import default_kwargs
from dspec_cli.core.data import BUILTIN, load_prompts
from dspec_cli.core.devices import parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, embedded_path
from dspec_cli.core.outputs import (
    check_output_dir,
    check_output_file,
    is_stdout,
    replace_folder,
    write_json,
)
from dspec_cli.core.sampling import SamplingConfig
from dspec_cli.core.specs import check_block_size, parse_drafter_spec
from dspec_cli.runtime.drafter import Drafter
from dspec_cli.runtime.engine import GenerationConfig
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.calibrate import (
    Rounds,
    calibrate,
    record_rounds,
    reliability,
    save_traces,
    threshold_sweep,
)
from dspec_cli.workflows.plots import reliability_diagram, threshold_sweep_plot
from dspec_cli.workflows.sglang_sts import load_rounds, sts_dict

MIN_ROUNDS = 20  # fewer rounds at a position than this: refused unless ``force``
FEW_ROUNDS = 200  # fewer than this: a warning (the fitted temperature is noisy)
REPORT_METRICS = ("count", "ece", "auroc", "brier", "mean_pred", "mean_label")


@dataclass(frozen=True, kw_only=True)
class CalibrateOptions(SamplingConfig):
    """What ``dspec calibrate`` was asked for (docs/calibration.md); paths as given."""

    drafter: str  # NAME[,KEY=VALUE...] (parse_drafter_spec)
    checkpoint: str | None = None  # folder or Hub id; None: the drafter's default
    datasets: Sequence[str] = ()
    traces: Path | None = None  # fit on recorded rounds (jsonl or SGLang STS shards) instead
    sglang_sts: Path | None = None
    num_prompts: int | None = None
    max_new_tokens: int = 128
    target: str | None = None
    block_size: int | None = None  # None: the checkpoint's
    concurrency: int = 8
    device: str = "auto"
    dtype: str = "auto"
    output: Path | None = None  # a complete calibrated copy of the checkpoint
    in_place: bool = False  # rewrite calibration.json in the local checkpoint folder
    overwrite: bool = False
    force: bool = False
    strict: bool = False
    plots: Path | None = None
    sweep_threshold: bool = False
    save_traces: Path | None = None
    chat_template_kwargs: dict = field(default_factory=default_kwargs)  # how prompts are rendered


@dataclass
class CalibrateResult:
    """A finished calibration: what the command prints and the JSON report."""

    calibration: Calibration
    rounds: Rounds
    used: int  # prompts run (0 with traces)
    skipped: int  # prompts that did not fit the target's context
    sweep: list[dict] | None
    calibration_file: Path | None
    written: list[Path]  # every file written, in order (calibration.json first when there is one)

    def report(self) -> dict:
        """The ``--json`` report."""
        before, after = self.calibration.metrics["before"], self.calibration.metrics["after"]
        return {
            "drafter": self.calibration.drafter, "block_size": self.rounds.block_size, "num_rounds": len(self.rounds),
            "num_prompts": self.used, "skipped_prompts": self.skipped,
            "calibration_file": str(self.calibration_file) if self.calibration_file else None,
            "temperatures": self.calibration.temperatures, "ece_before": before["ece_mean"],
            "ece_after": after["ece_mean"], "before": {k: before[k] for k in REPORT_METRICS},
            "after": {k: after[k] for k in REPORT_METRICS}, "threshold_sweep": self.sweep,
        }


def plan_output(checkpoint: str | None, output: Path | None, in_place: bool, overwrite: bool) -> Path:
    """Where calibration.json goes, checked before any model loads: a new complete copy in
    ``output``, or (``in_place``) the local checkpoint folder itself."""
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


def write_copy(model: Drafter | None, source: Path | None, cal: Calibration, out_dir: Path) -> Path:
    """A complete checkpoint in ``out_dir`` (the ``source`` folder's files, else ``model`` saved)
    with the new calibration.json, built beside and swapped in (:func:`~dspec_cli.core.outputs.replace_folder`):
    the folder holds that checkpoint only, and an interruption leaves no half copy."""

    def build(staging: Path) -> str:
        if source is not None:
            shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".cache", ".git*"), dirs_exist_ok=True,
                            copy_function=shutil.copyfile)  # new files: the mode of every other file
        elif model is not None:
            model.save_pretrained(staging)
        else:
            raise ValueError("write_copy needs a source folder or a model")
        return cal.save(staging).name

    return out_dir / replace_folder(out_dir, build)


def check_rounds(counts: list[int], force: bool) -> None:
    """Refuse a fit resting on fewer than MIN_ROUNDS rounds at some position (unless ``force``);
    warn below FEW_ROUNDS."""
    k = min(range(len(counts)), key=counts.__getitem__)
    hint = "use more prompts (--dataset, --num-prompts) or a larger --max-new-tokens"
    if counts[k] < MIN_ROUNDS and not force:
        raise DspecError(f"only {counts[k]} rounds reached position {k + 1} (at least {MIN_ROUNDS} needed, "
                         f"{FEW_ROUNDS} recommended): {hint}, or pass --force")
    if counts[k] < FEW_ROUNDS:
        warnings.warn(f"only {counts[k]} rounds reached position {k + 1}; its temperature is noisy "
                      f"({FEW_ROUNDS} rounds recommended): {hint}", stacklevel=2)


def _check(opts: CalibrateOptions) -> type[Drafter]:
    """Every option that can be checked before a model loads; returns the drafter class."""
    if opts.num_prompts is not None and opts.num_prompts < 1:
        raise DspecError(f"--num-prompts must be >= 1, got {opts.num_prompts}")
    if opts.block_size is not None:
        check_block_size(opts.block_size)
    cls, _ = parse_drafter_spec(opts.drafter)
    if not {"confidence", "draft_probs"} & set(cls.capabilities):
        raise DspecError(f"drafter {cls.name!r} has no confidence signal (no confidence head, no draft "
                         "probabilities): its confidences are constant, so there is nothing to calibrate")
    if opts.traces is not None and opts.datasets:
        raise DspecError("give --dataset (run the drafter) or --traces (recorded rounds), not both")
    GenerationConfig(max_new_tokens=opts.max_new_tokens, max_batch=opts.concurrency)  # the run options checked up front
    resolve_device(opts.device)
    parse_dtype(opts.dtype)
    return cls


def _record(opts: CalibrateOptions, checkpoint: Path | None,
            progress: Callable[[str, int], Callable] | None) -> tuple[Rounds, Drafter, Target, int, int]:
    """Run the drafter on the prompts: (raw rounds, the drafter, the target, prompts used, skipped)."""
    prompts = [p for d in (opts.datasets or [BUILTIN]) for p in load_prompts(d, opts.num_prompts)]
    target_name = choose_target(opts.target, [checkpoint])  # no --target: the one the checkpoint was trained for
    target = Target.load(target_name, dtype=opts.dtype, device=opts.device)
    model = load_drafter(opts.drafter, target, checkpoint, opts.block_size)
    config = GenerationConfig(**opts.sampling(), max_new_tokens=opts.max_new_tokens, block_size=model.config.block_size,
                              max_batch=opts.concurrency)
    per_total = (lambda total: progress(f"collecting rounds · {model.name}", total)) if progress else None
    rounds, used, skipped = record_rounds(target, model, [p.text for p in prompts], config, strict=opts.strict,
                                          progress=per_total, chat_template_kwargs=opts.chat_template_kwargs)
    if skipped:
        warnings.warn(f"skipped {skipped} of {len(prompts)} prompt(s) that do not fit the target's context with "
                      f"--max-new-tokens {opts.max_new_tokens} (--strict makes this an error)", stacklevel=2)
    return rounds, model, target, used, skipped


def run_calibrate(opts: CalibrateOptions, progress: Callable[[str, int], Callable] | None = None) -> CalibrateResult:
    """Fit STS on ``opts.drafter``'s raw confidences and write every requested output.

    Outputs are checked before any model loads. ``progress(description, total)`` returns a
    per-request callback (for progress bars).
    """
    cls = _check(opts)
    sts_only = opts.traces is not None and opts.sglang_sts is not None and opts.output is None and not opts.in_place
    out_dir = None if sts_only else plan_output(opts.checkpoint, opts.output, opts.in_place, opts.overwrite)
    check_output_file(opts.sglang_sts, "--sglang-sts")
    check_output_dir(opts.plots, "--plots")
    check_output_file(opts.save_traces, "--save-traces", overwrite=opts.overwrite)
    ckpt_dir = resolve_checkpoint(opts.checkpoint) if opts.checkpoint else None  # a Hub id -> its cached snapshot
    old_file = ckpt_dir / CALIBRATION_FILE if ckpt_dir else None
    old = Calibration.load(old_file, drafter=cls.name) if old_file and old_file.is_file() else None
    model, used, skipped = None, 0, 0
    if opts.traces is not None:  # raw confidences as recorded (SGLang records the head's output before STS)
        rounds, meta = load_rounds(opts.traces, opts.block_size)
        if meta["drafter"] and meta["drafter"] != cls.name:
            raise DspecError(f"traces {opts.traces} are of drafter {meta['drafter']!r}, not {cls.name!r}")
        if out_dir is not None and ckpt_dir is None:  # the default drafter's checkpoint is the embedded one
            ckpt_dir = embedded_path("drafters") / cls.name
            if not (ckpt_dir / "config.json").is_file():
                raise DspecError(f"with --traces, --output needs the --checkpoint the traces belong to "
                                 f"(no {cls.name} drafter is embedded)")
        title = f"{cls.name} · traces {opts.traces.name}"
    else:
        rounds, model, target, used, skipped = _record(opts, ckpt_dir, progress)
        title = (f"{cls.name} · {opts.target or 'embedded:tiny-target'} · {target.device} · "
                 f"temperature {opts.temperature:g}")
    if old is not None:
        old.check(cls.name, rounds.block_size)
    cal = calibrate(rounds, cls.name, chat_template_kwargs=None if opts.traces else opts.chat_template_kwargs)
    check_rounds(cal.metrics["before"]["count"], opts.force)
    written: list[Path] = []
    cal_file = None
    if out_dir is not None:
        cal_file = cal.save(out_dir) if opts.in_place else write_copy(model, ckpt_dir, cal, out_dir)
        written.append(cal_file)
    if opts.sglang_sts is not None:
        dataset = str(opts.traces or ",".join(opts.datasets) or BUILTIN)
        sts_file = write_json(opts.sglang_sts, sts_dict(cal, dataset=dataset, num_samples=len(rounds)))
        written += [Path(sts_file)] if sts_file else []  # None: written to stdout
    if opts.save_traces is not None:
        save_traces(opts.save_traces, rounds, drafter=cls.name, block_size=rounds.block_size)
        written += [] if is_stdout(opts.save_traces) else [opts.save_traces]
    sweep = threshold_sweep(rounds) if opts.sweep_threshold else None
    if opts.plots is not None:
        before, after = reliability(rounds), reliability(rounds.with_temperatures(cal.temperatures))
        written.append(reliability_diagram(before, after, opts.plots / "reliability.png", title=title))
        if sweep is not None:
            written.append(threshold_sweep_plot(sweep, opts.plots / "threshold_sweep.png", title=title))
    return CalibrateResult(cal, rounds, used, skipped, sweep, cal_file, written)
