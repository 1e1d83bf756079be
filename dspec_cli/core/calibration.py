"""A drafter's confidence calibration (``calibration.json``): per chain verification rule, the
map from the drafter's raw confidences to calibrated ones that the engine applies before any
scheduler reads them (docs/calibration.md). Fitting lives in :mod:`dspec_cli.workflows.calibrate`.

Each rule's fit holds two forms:

* the **survival map**, what dspec applies: s_k = σ(slope_k · logit(Π_{j≤k} c_j) + offset_k) for
  the chance that the accepted prefix reaches position k, made non-increasing over k (running
  minimum) and handed on as conditional confidences c'_k = s_k / s_{k−1}, so the schedulers'
  products Π_{j≤k} c'_j are s_k;
* **STS temperatures**, c_k ← σ(logit(c_k) / T_k) (DSpark paper §3.2.1): what SGLang's STS file
  carries, and what a fit without a survival map (an older file) applies.

Files from before the rule was recorded hold one top-level ``temperatures`` list: they are read
as the token rule's STS fit (``recorded_rule`` False) and say so where it matters. A file is read
as a typed record (:class:`CalibrationRecord`): errors name the file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from pydantic import ConfigDict, Field, JsonValue, model_validator

from dspec_cli.core.chat_template import check_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, read_json
from dspec_cli.core.outputs import atomic_write_text
from dspec_cli.core.records import (
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Record,
    validate,
)

Rule = Literal["token", "block"]  # the chain verification rules a fit can be for (docs/verification.md)
RULES: tuple[str, ...] = get_args(Rule)
UNRECORDED_RULE = "token"  # the rule taken for files that do not record one
CONFIDENCE_EPS = 1e-6  # confidences are clamped into (eps, 1 − eps) before the survival map's logs


class CalibrationRuleMismatch(UserWarning):
    """A calibration applied under a verification rule it has no fit for."""


def apply_temperatures(confidence: torch.Tensor, temperatures: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    """σ(logit(c_k) / T_k) per position of confidence [..., γ], temperatures [γ'] (a list or a
    tensor; positions past them keep T = 1)."""
    if temperatures is None or len(temperatures) == 0:
        return confidence
    temps = _row(temperatures, 1.0, confidence.device, confidence.dtype, confidence.shape[-1])
    return torch.sigmoid(torch.logit(confidence) / temps)


def apply_survival(confidence: torch.Tensor, slope: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Conditional confidences [..., γ] whose running products are the survival map's
    s_k = cummin_{j≤k} σ(slope_j · logit(Π_{i≤j} c_i) + offset_j), from confidence [..., γ] and
    slope, offset [γ] float64. Position k's output depends on c_1..c_k only (non-anticipating)."""
    c = confidence.double().clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS)
    log_a = c.log().cumsum(-1)  # log Π c, < 0
    logit_a = log_a - torch.log(-torch.expm1(log_a))
    s = torch.sigmoid(slope * logit_a + offset).cummin(-1).values
    prev = torch.cat([torch.ones_like(s[..., :1]), s[..., :-1]], -1)
    return torch.where(prev > 0, s / prev.clamp(min=1e-300), 0.0).clamp(0.0, 1.0).to(confidence.dtype)


def _row(values, default: float, device: torch.device, dtype: torch.dtype, gamma: int) -> torch.Tensor:
    """[γ] values for positions 1..γ, ``default`` past the end of the list."""
    row = torch.full((gamma,), default, dtype=dtype, device=device)
    t = torch.as_tensor(values, dtype=dtype, device=device)[:gamma]
    row[: t.numel()] = t
    return row


@dataclass
class RuleFit:
    """One verification rule's calibration."""

    temperatures: list[float]  # STS T_1..T_γ (what SGLang's STS file takes)
    slope: list[float] | None = None  # survival map per position; None: STS is what applies
    offset: list[float] | None = None
    metrics: dict = field(default_factory=dict)  # {"before", "sts", "after", "heldout": {...}}: position metrics
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # apply's rows per device

    def apply(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences of confidence [..., γ'] (γ' <= block size). The engine calls this
        every round: the parameter rows are built once per device, dtype and γ'."""
        key = (confidence.device, confidence.dtype, confidence.shape[-1])
        rows = self._rows.get(key)
        if rows is None:
            if self.slope is None or self.offset is None:
                rows = (_row(self.temperatures, 1.0, *key),)
            else:
                dev, gamma = key[0], key[2]
                rows = (_row(self.slope, 1.0, dev, torch.float64, gamma), _row(self.offset, 0.0, dev, torch.float64, gamma))
            self._rows[key] = rows
        if len(rows) == 1:
            return torch.sigmoid(torch.logit(confidence) / rows[0])
        return apply_survival(confidence, *rows)

    def scale(self, confidence: torch.Tensor) -> torch.Tensor:
        """The STS temperatures alone, position by position, on confidence [..., γ'] (for
        confidences that are not one chain's, e.g. tree nodes)."""
        return apply_temperatures(confidence, self.temperatures)

    def to_dict(self) -> dict:
        out: dict = {"temperatures": self.temperatures}
        if self.slope is not None:
            out["survival"] = {"slope": self.slope, "offset": self.offset}
        out["metrics"] = self.metrics
        return out

    @classmethod
    def from_record(cls, rec: FitRecord) -> RuleFit:
        """The fit a file's record holds."""
        surv = rec.survival
        return cls(list(rec.temperatures), None if surv is None else list(surv.slope),
                   None if surv is None else list(surv.offset), dict(rec.metrics))


@dataclass
class Calibration:
    """Per-rule fits for one drafter and block size (``calibration.json``)."""

    drafter: str
    block_size: int
    fits: dict[str, RuleFit]  # verification rule -> its fit
    source: str = ""  # the file it was read from (for messages)
    # the chat-template kwargs the fitted rounds' prompts were rendered with; None: not known
    chat_template_kwargs: dict | None = None
    recorded_rule: bool = True  # False: a file that records no rule; its fit is taken as the token rule's

    @classmethod
    def sts(cls, drafter: str, block_size: int, temperatures: list[float], rule: str = UNRECORDED_RULE,
            metrics: dict | None = None, **kwargs) -> Calibration:
        """A calibration holding one rule's STS temperatures."""
        return cls(drafter, block_size, {rule: RuleFit(temperatures, metrics=metrics or {})}, **kwargs)

    @property
    def rules(self) -> list[str]:
        return [r for r in RULES if r in self.fits]

    def fit(self, rule: str) -> RuleFit:
        """The fit for ``rule``, else (see :meth:`rule_warning`) the one fitted under another rule."""
        return self.fits.get(rule) or self.fits[self.rules[0]]

    def rule_warning(self, rule: str, name: str = "") -> str | None:
        """A one-line warning when this calibration has no fit for verification rule ``rule``
        (what it then applies, and the command that fits it); None when it has one."""
        if rule in self.fits:
            return None
        where = f"the calibration of drafter {name or self.drafter} ({self.source or 'calibration.json'})"
        fitted = (f"records no verification rule and is taken as the {UNRECORDED_RULE} rule's"
                  if not self.recorded_rule else f"was fitted under the {' and '.join(self.rules)} rule")
        folder = Path(self.source).parent if self.source else "DIR"
        return (f"{where} {fitted}, but this run verifies by the {rule} rule: its survival estimates are off "
                f"(the {rule} rule accepts other prefixes); fit it with `dspec calibrate --drafter "
                f"{self.drafter or 'NAME'} --checkpoint {folder} --verify {rule} --in-place`")

    def check(self, drafter: str | None = None, block_size: int | None = None) -> None:
        """DspecError unless this calibration belongs to ``drafter`` at ``block_size``."""
        where = self.source or "calibration"
        if drafter is not None and self.drafter and self.drafter != drafter:
            raise DspecError(f"{where} is for drafter {self.drafter!r}, not {drafter!r}")
        if block_size is not None and self.block_size != block_size:
            raise DspecError(f"{where} is for block size {self.block_size}, not {block_size}")

    def apply(self, confidence: torch.Tensor, rule: str = UNRECORDED_RULE) -> torch.Tensor:
        """Calibrated confidences of confidence [..., γ'] for rounds verified by ``rule`` (its fit,
        else the other rule's: :meth:`rule_warning`)."""
        return self.fit(rule).apply(confidence)

    def with_fits(self, fits: dict[str, RuleFit], **changes) -> Calibration:
        """The same drafter and block size with ``fits`` (and other ``changes``)."""
        keep = {"source": self.source, "chat_template_kwargs": self.chat_template_kwargs,
                "recorded_rule": self.recorded_rule}
        return Calibration(self.drafter, self.block_size, fits, **{**keep, **changes})

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "block_size": self.block_size,
                "chat_template_kwargs": self.chat_template_kwargs,
                "rules": {rule: self.fits[rule].to_dict() for rule in self.rules}}

    def save(self, path: str | Path) -> Path:
        """Write to ``path`` (a folder gets ``calibration.json`` inside); returns the file."""
        path = Path(path)
        file = path / CALIBRATION_FILE if path.is_dir() else path
        atomic_write_text(file, json.dumps(self.to_dict(), indent=2) + "\n")
        return file

    @classmethod
    def from_dict(cls, raw, where: str) -> Calibration:
        """A ``calibration.json`` object as its :class:`CalibrationRecord` (the one place its layout
        is read); errors start with ``where`` and name the field. A file without ``rules`` but with
        top-level ``temperatures`` (and ``metrics``) is an older one: its fit is taken as the token
        rule's."""
        rec = validate(CalibrationRecord, raw, where)
        if rec.rules is not None:
            fits = {rule: RuleFit.from_record(fit) for rule, fit in rec.rules.items()}
        else:
            fits = {UNRECORDED_RULE: RuleFit(list(rec.temperatures or []), metrics=dict(rec.metrics))}
        kwargs = rec.chat_template_kwargs
        return cls(rec.drafter, rec.block_size or len(rec.temperatures or []), fits, where,
                   None if kwargs is None else check_kwargs(kwargs, f"{where}: chat_template_kwargs"),
                   rec.rules is not None)

    @classmethod
    def load(cls, path: str | Path, *, drafter: str | None = None, block_size: int | None = None,
             what: str = "calibration file") -> Calibration:
        """Read a file (or a folder's ``calibration.json``, or SGLang's STS file: its
        ``temperatures``) and check it fits drafter / block size; errors start with ``what`` (the
        option naming the file), the path and the field."""
        path = Path(path)
        file = path / CALIBRATION_FILE if path.is_dir() else path
        raw = read_json(file, what)
        try:
            cal = cls.from_dict(raw, str(file))
            cal.check(drafter, block_size)
        except DspecError as exc:  # its checks name the file: add the option
            raise DspecError(f"{what} {exc}") from None
        return cal


Temperatures = Annotated[list[PositiveFloat], Field(min_length=1, max_length=4096)]  # T_k per position


class SurvivalRecord(Record):
    """A rule's survival map: slope_k >= 0 and offset_k per position."""

    slope: list[NonNegativeFloat]
    offset: list[float]


class FitRecord(Record):
    """One verification rule's fit in ``calibration.json``."""

    temperatures: Temperatures
    survival: SurvivalRecord | None = None  # None: STS is what applies
    metrics: dict[str, JsonValue] = {}


class CalibrationRecord(Record):
    """``calibration.json``: ``rules`` (verification rule -> fit), or one top-level
    ``temperatures`` list (older files, SGLang's STS file: other top-level keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    drafter: str = ""
    block_size: PositiveInt | None = None  # an older file's default: the number of its temperatures
    chat_template_kwargs: dict[str, JsonValue] | None = None
    rules: dict[Rule, FitRecord] | None = Field(None, min_length=1)
    temperatures: Temperatures | None = None  # an older file's fit ...
    metrics: dict[str, JsonValue] = {}  # ... and its metrics

    @model_validator(mode="after")
    def _one_value_per_position(self) -> CalibrationRecord:
        if self.rules is None:
            if self.temperatures is None:
                raise ValueError("expected 'rules' (or an older file's 'temperatures')")
            lists = {"temperatures": self.temperatures}
        elif self.block_size is None:
            raise ValueError("block_size: missing (a file with rules records it)")
        else:
            lists = {}
            for rule, fit in self.rules.items():
                lists[f"rules.{rule}.temperatures"] = fit.temperatures
                if fit.survival is not None:
                    lists[f"rules.{rule}.survival.slope"] = fit.survival.slope
                    lists[f"rules.{rule}.survival.offset"] = fit.survival.offset
        size = self.block_size or len(self.temperatures or [])
        for name, values in lists.items():
            if len(values) != size:
                raise ValueError(f"{name}: {len(values)} values for block size {size}")
        return self
