"""A drafter's confidence calibration: per-position STS temperatures (``calibration.json``) and
the one function that applies them, σ(logit(c_k) / T_k) (DSpark paper §3.2.1). Fitting lives in
:mod:`dspec_cli.workflows.calibrate`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspec_cli.core.chat_template import check_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, read_json
from dspec_cli.core.outputs import atomic_write_text


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

    def __post_init__(self) -> None:
        where = self.source or "calibration"
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise DspecError(f"{where}: block_size must be a positive integer, got {self.block_size!r}")
        temps = self.temperatures
        if not isinstance(temps, list) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in temps
        ):
            raise DspecError(f"{where}: temperatures must be a list of positive numbers")
        if len(temps) != self.block_size:
            raise DspecError(f"{where}: {len(temps)} temperatures for block size {self.block_size}")

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
        """Read a file (or a folder's ``calibration.json``) and check it fits drafter / block size;
        errors start with ``what`` (the option naming the file) and the path.

        Files holding only ``{"temperatures": [...]}`` are accepted (block size = their length,
        drafter and chat-template kwargs unknown).
        """
        path = Path(path)
        file = path / CALIBRATION_FILE if path.is_dir() else path
        raw = read_json(file, what)
        where = f"{what} {file}"
        if not isinstance(raw, dict) or "temperatures" not in raw:
            raise DspecError(f"{where}: expected an object with 'temperatures'")
        temps = raw["temperatures"]
        size = raw.get("block_size", len(temps) if isinstance(temps, list) else 0)
        metrics = raw.get("metrics", {})
        kwargs = raw.get("chat_template_kwargs")
        try:
            cal = cls(str(raw.get("drafter", "")), size, temps, metrics if isinstance(metrics, dict) else {}, str(file),
                      None if kwargs is None else check_kwargs(kwargs, f"{file}: chat_template_kwargs"))
            cal.check(drafter, block_size)
        except DspecError as exc:  # its checks name the file: add the option
            raise DspecError(f"{what} {exc}") from None
        return cal
