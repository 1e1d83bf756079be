"""``dspec calibrate``: record a drafter's rounds under each verification rule asked for (or read
recorded ones), fit STS and the survival map per rule, write ``calibration.json`` and the side
outputs, or (``evaluate``) score the checkpoint's calibration on new rounds; the fitting itself
is :mod:`~dspec_cli.workflows.calibrate`."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dspec_cli.checkpoints import load_drafter
from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.checkpoints.native import choose_target
from dspec_cli.core.calibration import (
    RULES,
    UNRECORDED_RULE,
    Calibration,
    CalibrationRuleMismatch,
)
from dspec_cli.core.chat_template import default_kwargs
from dspec_cli.core.data import BUILTIN, load_prompts
from dspec_cli.core.devices import parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, embedded_path
from dspec_cli.core.outputs import (
    check_output_dir,
    check_output_file,
    is_special,
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
    evaluate,
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


def default_rule() -> str:
    """The chain rule ``dspec bench`` verifies by when given none."""
    return GenerationConfig().chain_verify


@dataclass(frozen=True, kw_only=True)
class CalibrateOptions(SamplingConfig):
    """What ``dspec calibrate`` was asked for (docs/calibration.md); paths as given."""

    drafter: str  # NAME[,KEY=VALUE...] (parse_drafter_spec)
    checkpoint: str | None = None  # folder or Hub id; None: the drafter's default
    datasets: Sequence[str] = ()
    traces: Path | None = None  # fit on recorded rounds (jsonl or SGLang STS shards) instead
    sglang_sts: Path | None = None
    verify: Sequence[str] = ()  # chain rules to fit, each on its own run; (): the rule bench uses by default
    evaluate: bool = False  # score the checkpoint's calibration on these rounds; fit and write nothing
    num_prompts: int | None = None
    max_new_tokens: int = 128
    target: str | None = None
    block_size: int | None = None  # None: the checkpoint's
    concurrency: int = 8
    device: str = "auto"
    dtype: str = "auto"
    batch_invariant: bool | None = None  # batch-invariant target forwards; None: the default rule (GenerationConfig)
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
    """A finished calibration (or evaluation): what the command prints and the JSON report."""

    calibration: Calibration  # what was written (the new fits and the kept ones), or what was evaluated
    rounds: dict[str, Rounds]  # verification rule -> its raw rounds
    metrics: dict[str, dict]  # rule -> the metrics of this run (a fit's, or the evaluation's)
    used: int  # prompts run per rule (0 with traces)
    skipped: int  # prompts that did not fit the target's context
    sweep: dict[str, list[dict]] | None
    calibration_file: Path | None
    written: list[Path]  # every file written, in order (calibration.json first when there is one)
    kept: list[str] = field(default_factory=list)  # rules whose earlier fit the file keeps
    evaluated: bool = False

    def report(self) -> dict:
        """The ``--json`` report."""
        rules = {}
        for rule, rounds in self.rounds.items():
            m, fit = self.metrics[rule], self.calibration.fit(rule)
            held = m.get("heldout", {})
            rules[rule] = {
                "num_rounds": len(rounds), "temperatures": fit.temperatures,
                "survival": {"slope": fit.slope, "offset": fit.offset} if fit.slope is not None else None,
                "ece_before": m["before"]["ece_mean"], "ece_sts": m["sts"]["ece_mean"], "ece_after": m["after"]["ece_mean"],
                "ece_sts_heldout": held.get("sts", {}).get("ece_mean"), "ece_heldout": held.get("after", {}).get("ece_mean"),
                "heldout_split": held.get("split"), "ece_floor": m.get("floor"),
                **{k: {key: m[k][key] for key in REPORT_METRICS} for k in ("before", "sts", "after")},
                "heldout": {k: {key: held[k][key] for key in REPORT_METRICS} for k in ("sts", "after")} if held else None,
                "threshold_sweep": self.sweep.get(rule) if self.sweep else None,
            }
        return {
            "drafter": self.calibration.drafter, "block_size": self.calibration.block_size,
            "evaluated": self.evaluated, "num_prompts": self.used, "skipped_prompts": self.skipped,
            "calibration_file": str(self.calibration_file) if self.calibration_file else None,
            "kept_rules": self.kept, "rules": rules,
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


def rules_to_fit(opts: CalibrateOptions) -> list[str]:
    """The chain rules asked for (``--verify``, each once), by default the one bench verifies by."""
    rules = list(dict.fromkeys(opts.verify)) or [default_rule()]
    for rule in rules:
        if rule not in RULES:
            raise DspecError(f"--verify must be one of {', '.join(RULES)}, got {rule!r}")
    return rules


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
    rules = rules_to_fit(opts)
    if opts.evaluate and (opts.output is not None or opts.in_place or opts.sglang_sts is not None):
        raise DspecError("--evaluate scores the checkpoint's calibration and writes none: drop --output, "
                         "--in-place and --sglang-sts")
    if opts.sglang_sts is not None and opts.traces is None and "token" not in rules:
        raise DspecError("--sglang-sts writes the token rule's temperatures (SGLang verifies token by token): "
                         "add --verify token")
    traces_outputs(opts)  # several rules: one file each, so not stdout
    GenerationConfig(max_new_tokens=opts.max_new_tokens, max_batch=opts.concurrency)  # the run options checked up front
    resolve_device(opts.device)
    parse_dtype(opts.dtype)
    return cls


def _record(opts: CalibrateOptions, checkpoint: Path | None, rules: Sequence[str],
            progress: Callable[[str, int], Callable] | None) -> tuple[dict[str, Rounds], Drafter, Target, int, int]:
    """Run the drafter on the prompts once per rule: ({rule that verified them: raw rounds}, the
    drafter, the target, prompts used, skipped)."""
    prompts = [p for d in (opts.datasets or [BUILTIN]) for p in load_prompts(d, opts.num_prompts)]
    target_name = choose_target(opts.target, [checkpoint])  # no --target: the one the checkpoint was trained for
    target = Target.load(target_name, dtype=opts.dtype, device=opts.device)
    GenerationConfig(batch_invariant=opts.batch_invariant).batch_invariance(target)  # an error before the drafter loads
    model = load_drafter(opts.drafter, target, checkpoint, opts.block_size)
    out: dict[str, Rounds] = {}
    used = skipped = 0
    for rule in rules:
        config = GenerationConfig(**opts.sampling(), max_new_tokens=opts.max_new_tokens, block_size=model.config.block_size,
                                  max_batch=opts.concurrency, chain_verify=rule, batch_invariant=opts.batch_invariant)
        per_total = (lambda total, r=rule: progress(f"collecting rounds · {model.name} · {r} rule", total)) if progress else None
        rounds, ran, used, skipped = record_rounds(target, model, [p.text for p in prompts], config, strict=opts.strict,
                                                   progress=per_total, chat_template_kwargs=opts.chat_template_kwargs)
        if ran != rule:
            warnings.warn(f"drafter {model.name} proposes no draft probabilities, so the engine verified its drafts "
                          f"by the {ran} rule (it accepts the same as the {rule} rule for one-hot drafts): "
                          f"fitted as the {ran} rule", stacklevel=2)
        out[ran] = rounds
    if skipped:
        warnings.warn(f"skipped {skipped} of {len(prompts)} prompt(s) that do not fit the target's context with "
                      f"--max-new-tokens {opts.max_new_tokens} (--strict makes this an error)", stacklevel=2)
    return out, model, target, used, skipped


def _from_traces(opts: CalibrateOptions, name: str) -> tuple[Rounds, str]:
    """Recorded raw rounds (SGLang records the head's output before STS) and their rule, which
    ``--verify`` (if given) must name."""
    assert opts.traces is not None
    rounds, meta = load_rounds(opts.traces, opts.block_size)
    if meta["drafter"] and meta["drafter"] != name:
        raise DspecError(f"traces {opts.traces} are of drafter {meta['drafter']!r}, not {name!r}")
    rule = meta["verify"]
    if rule is None:
        rule = UNRECORDED_RULE
        warnings.warn(f"traces {opts.traces} record no verification rule: taken as the {rule} rule's", stacklevel=2)
    if opts.verify and list(dict.fromkeys(opts.verify)) != [rule]:
        raise DspecError(f"traces {opts.traces} were verified by the {rule} rule; --verify "
                         f"{' '.join(opts.verify)} needs rounds verified by it "
                         "(record them with `dspec calibrate --verify RULE --save-traces FILE`)")
    return rounds, rule


def merge_fits(new: Calibration, old: Calibration | None) -> tuple[Calibration, list[str]]:
    """``new`` with the fits ``old`` (the checkpoint's file) has for other rules, and those rules;
    not kept (with a warning) when ``old`` records no rule or was fitted on prompts rendered with
    other chat-template kwargs."""
    others = [r for r in old.rules if r not in new.fits] if old is not None else []
    if old is None or not others:
        return new, []
    where = old.source or CALIBRATION_FILE
    if not old.recorded_rule:
        warnings.warn(f"{where} records no verification rule: its fit is replaced, not kept as the "
                      f"{others[0]} rule's (fit that rule with --verify {others[0]})", stacklevel=2)
        return new, []
    if None not in (old.chat_template_kwargs, new.chat_template_kwargs) and old.chat_template_kwargs != new.chat_template_kwargs:
        warnings.warn(f"{where} fitted the {' and '.join(others)} rule on prompts rendered with other chat-template "
                      f"kwargs ({old.chat_template_kwargs}): not kept (refit it with --verify)", stacklevel=2)
        return new, []
    return new.with_fits({r: (new.fits.get(r) or old.fits[r]) for r in RULES if r in new.fits or r in others}), others


def _named(path: Path, rule: str, several: bool) -> Path:
    """``path`` itself for one rule; ``<stem>-<rule><suffix>`` when several rules are written."""
    return path.with_name(f"{path.stem}-{rule}{path.suffix}") if several else path


def traces_outputs(opts: CalibrateOptions) -> list[Path]:
    """The files ``--save-traces`` writes: the path itself for one rule (or for ``--traces``), one
    ``<stem>-<rule><suffix>`` per rule when the drafter runs under several (then stdout and
    special files are refused: each rule needs a file of its own)."""
    if opts.save_traces is None:
        return []
    rules = rules_to_fit(opts) if opts.traces is None else [None]
    if len(rules) == 1:
        return [opts.save_traces]
    if is_stdout(opts.save_traces) or is_special(opts.save_traces):
        raise DspecError(f"--save-traces {opts.save_traces}: with several --verify rules each rule's rounds go to "
                         f"a file of their own (STEM-RULE{opts.save_traces.suffix}); give a file path")
    return [_named(opts.save_traces, rule, True) for rule in rules if rule is not None]


def _side_outputs(opts: CalibrateOptions, cal: Calibration, rounds: dict[str, Rounds], title: str,
                  written: list[Path]) -> dict[str, list[dict]] | None:
    """SGLang's STS file, traces, sweeps and plots of a finished fit (appended to ``written``)."""
    several = len(rounds) > 1
    if opts.sglang_sts is not None:
        if "token" not in rounds:
            raise DspecError(f"--sglang-sts writes the token rule's temperatures (SGLang verifies token by token), "
                             f"and --traces {opts.traces} were verified by the {next(iter(rounds))} rule")
        dataset = str(opts.traces or ",".join(opts.datasets) or BUILTIN)
        sts_file = write_json(opts.sglang_sts, sts_dict(cal, dataset=dataset, num_samples=len(rounds["token"])))
        written += [Path(sts_file)] if sts_file else []  # None: written to stdout
    sweeps = {rule: threshold_sweep(r) for rule, r in rounds.items()} if opts.sweep_threshold else None
    several_traces = len(traces_outputs(opts)) > 1  # named by the rules asked for, as checked up front
    for rule, r in rounds.items():
        if opts.save_traces is not None:
            path = _named(opts.save_traces, rule, several_traces)
            save_traces(path, r, drafter=cal.drafter, block_size=r.block_size, verify=rule)
            written += [] if is_stdout(path) else [path]
        if opts.plots is not None:
            label = f"{title} · {rule} rule"
            before, after = reliability(r), reliability(r.calibrated(cal.fit(rule)))
            written.append(reliability_diagram(before, after, _named(opts.plots / "reliability.png", rule, several),
                                               title=label))
            if sweeps is not None:
                written.append(threshold_sweep_plot(sweeps[rule], _named(opts.plots / "threshold_sweep.png", rule, several),
                                                    title=label))
    return sweeps


def run_calibrate(opts: CalibrateOptions, progress: Callable[[str, int], Callable] | None = None) -> CalibrateResult:
    """Fit STS and the survival map on ``opts.drafter``'s raw confidences under each rule and
    write every requested output (``opts.evaluate``: score the checkpoint's calibration instead).

    Outputs are checked before any model loads. ``progress(description, total)`` returns a
    per-request callback (for progress bars).
    """
    cls = _check(opts)
    sts_only = opts.traces is not None and opts.sglang_sts is not None and opts.output is None and not opts.in_place
    out_dir = None if sts_only or opts.evaluate else plan_output(opts.checkpoint, opts.output, opts.in_place, opts.overwrite)
    check_output_file(opts.sglang_sts, "--sglang-sts")
    check_output_dir(opts.plots, "--plots")
    for path in traces_outputs(opts):  # one file per rule when several are recorded
        check_output_file(path, "--save-traces", overwrite=opts.overwrite)
    ckpt_dir = resolve_checkpoint(opts.checkpoint) if opts.checkpoint else None  # a Hub id -> its cached snapshot
    if opts.traces is not None and ckpt_dir is None and (out_dir is not None or opts.evaluate):
        ckpt_dir = embedded_path("drafters") / cls.name  # the default drafter's checkpoint is the embedded one
        if not (ckpt_dir / "config.json").is_file():
            raise DspecError(f"with --traces, {'--evaluate' if opts.evaluate else '--output'} needs the --checkpoint "
                             f"the traces belong to (no {cls.name} drafter is embedded)")
    old_file = ckpt_dir / CALIBRATION_FILE if ckpt_dir else None
    old = Calibration.load(old_file, drafter=cls.name) if old_file and old_file.is_file() else None
    model, used, skipped = None, 0, 0
    if opts.traces is not None:
        rounds, rule = _from_traces(opts, cls.name)
        recorded = {rule: rounds}
        title = f"{cls.name} · traces {opts.traces.name}"
    else:
        recorded, model, target, used, skipped = _record(opts, ckpt_dir, rules_to_fit(opts), progress)
        if old is None and model.calibration is not None and model.calibration.block_size == model.config.block_size:
            old = model.calibration  # the default drafter's embedded calibration
        title = (f"{cls.name} · {opts.target or 'embedded:tiny-target'} · {target.device} · "
                 f"temperature {opts.temperature:g}")
    block = next(iter(recorded.values())).block_size
    if old is not None:
        old.check(cls.name, block)
    if opts.evaluate:
        cal, metrics = _evaluate(old, recorded, cls.name)
        written: list[Path] = []
        sweep = _side_outputs(opts, cal, recorded, title, written)
        return CalibrateResult(cal, recorded, metrics, used, skipped, sweep, None, written, evaluated=True)
    kwargs = None if opts.traces else opts.chat_template_kwargs
    fits = {}
    for rule, rounds in recorded.items():
        fits[rule] = calibrate(rounds, cls.name, rule, chat_template_kwargs=kwargs).fits[rule]
        check_rounds(fits[rule].metrics["before"]["count"], opts.force)
    cal, kept = merge_fits(Calibration(cls.name, block, fits, chat_template_kwargs=kwargs), old)
    written = []
    cal_file = None
    if out_dir is not None:
        cal_file = cal.save(out_dir) if opts.in_place else write_copy(model, ckpt_dir, cal, out_dir)
        written.append(cal_file)
    sweep = _side_outputs(opts, cal, recorded, title, written)
    return CalibrateResult(cal, recorded, {r: f.metrics for r, f in fits.items()}, used, skipped, sweep, cal_file,
                           written, kept)


def _evaluate(cal: Calibration | None, recorded: dict[str, Rounds], name: str) -> tuple[Calibration, dict[str, dict]]:
    """--evaluate: (the checkpoint's calibration, its metrics per rule on rounds it was not fitted
    on), with a warning where it has no fit for a rule."""
    if cal is None:
        raise DspecError(f"--evaluate: drafter {name}'s checkpoint has no {CALIBRATION_FILE} to evaluate")
    metrics = {}
    for rule, rounds in recorded.items():
        message = cal.rule_warning(rule, name)
        if message:
            warnings.warn(message, CalibrationRuleMismatch, stacklevel=2)
        metrics[rule] = evaluate(cal.fit(rule), rounds)
    return cal, metrics
