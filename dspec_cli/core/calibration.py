"""A drafter's confidence calibration: per-position STS temperatures (``calibration.json``) and
the one function that applies them, σ(logit(c_k) / T_k) (DSpark paper §3.2.1). Fitting lives in
:mod:`dspec_cli.workflows.calibrate`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ConfigDict, Field, JsonValue, model_validator

from dspec_cli.core.chat_template import check_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, read_json
from dspec_cli.core.outputs import atomic_write_text
from dspec_cli.core.records import PositiveFloat, PositiveInt, Record, validate


def apply_temperatures(confidence: torch.Tensor, temperatures: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    """σ(logit(c_k) / T_k) per position of confidence [..., γ], temperatures [γ'] (a list or a
    tensor; positions past them keep T = 1)."""
    if temperatures is None or len(temperatures) == 0:
        return confidence
    temps = _temperature_row(temperatures, confidence.device, confidence.dtype, confidence.shape[-1])
    return torch.sigmoid(torch.logit(confidence) / temps)


def _temperature_row(temperatures, device: torch.device, dtype: torch.dtype, gamma: int) -> torch.Tensor:
    """[γ] temperatures T_1..T_γ, 1 past the end of the list."""
    temps = torch.ones(gamma, dtype=dtype, device=device)
    t = torch.as_tensor(temperatures, dtype=dtype, device=device)[:gamma]
    temps[: t.numel()] = t
    return temps


@dataclass
class Calibration:
    """Per-position temperatures for one drafter and block size (``calibration.json``)."""

    drafter: str
    block_size: int
    temperatures: list[float]
    metrics: dict = field(default_factory=dict)  # {"before": position_metrics, "after": ...}
    source: str = ""  # the file it was read from (for messages)
    # the chat-template kwargs the fitted rounds' prompts were rendered with; None: not known
    chat_template_kwargs: dict | None = None
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # apply's temperature rows

    def check(self, drafter: str | None = None, block_size: int | None = None) -> None:
        """DspecError unless this calibration belongs to ``drafter`` at ``block_size``."""
        where = self.source or "calibration"
        if drafter is not None and self.drafter and self.drafter != drafter:
            raise DspecError(f"{where} is for drafter {self.drafter!r}, not {drafter!r}")
        if block_size is not None and self.block_size != block_size:
            raise DspecError(f"{where} is for block size {self.block_size}, not {block_size}")

    def apply(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated confidences of confidence [..., γ'] (γ' <= block size; past it T = 1). The
        engine calls this every round: the temperature row is built once per device, dtype and γ'."""
        key = (confidence.device, confidence.dtype, confidence.shape[-1])
        temps = self._rows.get(key)
        if temps is None:
            temps = self._rows[key] = _temperature_row(self.temperatures, *key)
        return torch.sigmoid(torch.logit(confidence) / temps)

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "block_size": self.block_size, "temperatures": self.temperatures,
                "chat_template_kwargs": self.chat_template_kwargs, "metrics": self.metrics}

    def save(self, path: str | Path) -> Path:
        """Write to ``path`` (a folder gets ``calibration.json`` inside); returns the file."""
        path = Path(path)
        file = path / CALIBRATION_FILE if path.is_dir() else path
        atomic_write_text(file, json.dumps(self.to_dict(), indent=2) + "\n")
        return file

    @classmethod
    def load(cls, path: str | Path, *, drafter: str | None = None, block_size: int | None = None,
             what: str = "calibration file") -> Calibration:
        """Read a file (or a folder's ``calibration.json``) as a :class:`CalibrationRecord` and check
        it fits drafter / block size; errors start with ``what`` (the option naming the file), the
        path and the field.

        Files holding only ``{"temperatures": [...]}`` (SGLang's STS files) are accepted (block
        size = their length, drafter and chat-template kwargs unknown).
        """
        path = Path(path)
        file = path / CALIBRATION_FILE if path.is_dir() else path
        where = f"{what} {file}"
        rec = validate(CalibrationRecord, read_json(file, what), where)
        cal = cls(rec.drafter, rec.block_size or len(rec.temperatures), list(rec.temperatures), dict(rec.metrics),
                  str(file), None if rec.chat_template_kwargs is None else check_kwargs(
                      rec.chat_template_kwargs, f"{where}: chat_template_kwargs"))
        try:
            cal.check(drafter, block_size)
        except DspecError as exc:  # its checks name the file: add the option
            raise DspecError(f"{what} {exc}") from None
        return cal


class CalibrationRecord(Record):
    """``calibration.json`` (or SGLang's STS file: its other keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    temperatures: list[PositiveFloat] = Field(min_length=1, max_length=4096)
    block_size: PositiveInt | None = None  # default: the number of temperatures
    drafter: str = ""
    chat_template_kwargs: dict[str, JsonValue] | None = None
    metrics: dict[str, JsonValue] = {}

    @model_validator(mode="after")
    def _one_temperature_per_position(self) -> CalibrationRecord:
        if self.block_size is not None and self.block_size != len(self.temperatures):
            raise ValueError(f"{len(self.temperatures)} temperatures for block size {self.block_size}")
        return self
