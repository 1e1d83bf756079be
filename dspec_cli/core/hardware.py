"""Hardware facts: the target's steps per second SPS(B) for token-batch sizes B (DSpark §3.2.2)
as a cost table, and device facts (names, native half precision).

:class:`CostTable` is what profiling writes (:mod:`dspec_cli.workflows.target_profile`,
:mod:`dspec_cli.workflows.step_profile`) and what the schedulers read. Lookups
(:meth:`CostTable.sps`) interpolate the step *time* linearly in B (and in C between profiled
contexts, clamped outside; ``context=None`` averages the step time over contexts). Past the
largest profiled B the time grows proportionally to B. Before any lookup the measured curve
is cleaned to be monotone: the step time is replaced by its least-squares non-decreasing fit
over B (:func:`isotonic`), so SPS(B) never increases with B. Noise cannot make a larger batch
look faster, and, unlike a running maximum, one slow outlier does not raise every larger B
(on a flat stretch that would invent a marginal cost the hardware does not have); real steps
and cliffs stay. The raw medians stay in the file.
"""

from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field, model_validator

from dspec_cli.core import sglang_sps
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import read_json
from dspec_cli.core.outputs import write_json
from dspec_cli.core.records import (
    Count,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Record,
    validate,
)


class CostTableMismatch(UserWarning):
    """A cost table profiled on another device or model."""


class SlowHalfPrecision(UserWarning):
    """Half-precision weights on a CPU whose instruction set has no native matmul for them."""


# x86 CPU flags (Linux /proc/cpuinfo) of native half-precision matmul support.
_NATIVE_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_native_half(dtype: torch.dtype) -> bool | None:
    """Whether this CPU multiplies ``dtype`` natively; None where that cannot be told (not x86
    Linux, or not a half-precision dtype). Without it PyTorch falls back to a path that ran a
    [4096, 256] x [256, 8192] bf16 matmul ~180x slower than float32 on an AVX2-only EPYC."""
    lines = _cpuinfo()
    if dtype not in _NATIVE_HALF_FLAGS or platform.machine() not in ("x86_64", "AMD64") or not lines:
        return None
    flags = {f for line in lines if line.startswith("flags") for f in line.split()}
    return any(f in flags for f in _NATIVE_HALF_FLAGS[dtype])


def _cpuinfo() -> list[str]:
    """Lines of /proc/cpuinfo ([] where there is none)."""
    path = Path("/proc/cpuinfo")
    return path.read_text().splitlines() if path.exists() else []


def warn_if_slow_half(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Warn (:class:`SlowHalfPrecision`) when ``dtype`` on ``device`` is a CPU without native
    support for it; return whether it warned."""
    if dtype not in _NATIVE_HALF_FLAGS or torch.device(device).type != "cpu" or cpu_native_half(dtype) is not False:
        return False
    flags = " / ".join(_NATIVE_HALF_FLAGS[dtype])
    warnings.warn(f"{str(dtype).removeprefix('torch.')} on this CPU (no {flags}) runs matmuls in a slow "
                  "fallback, far slower than float32: use --dtype float32", SlowHalfPrecision, stacklevel=3)
    return True


def device_name(device: torch.device | str) -> str:
    """Human-readable name of a device: the GPU model, or the CPU model (so a cost table
    profiled on one CPU is flagged on another, as on another GPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def isotonic(values: torch.Tensor) -> torch.Tensor:
    """Least-squares non-decreasing fit of values [G] (pool adjacent violators): runs that
    decrease are replaced by their mean."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for v in values.tolist():
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fit = [total / count for total, count in blocks for _ in range(int(count))]
    return torch.tensor(fit, dtype=values.dtype)


def default_grid(max_tokens: int) -> list[int]:
    """Every B up to 16, then steps of 4 to 64, 8 to 128, 16 to 256, 32 beyond; ends at max_tokens."""
    if max_tokens < 1:
        raise DspecError(f"--max-batch-tokens must be >= 1, got {max_tokens}")
    grid = list(range(1, 17)) + list(range(20, 65, 4)) + list(range(72, 129, 8)) + list(range(144, 257, 16))
    grid += list(range(288, max_tokens + 1, 32))
    return sorted({b for b in grid if b <= max_tokens} | {max_tokens})


@dataclass
class CostTable:
    """SPS(B) per profiled context length, with where and how it was measured."""

    device: str
    device_name: str
    dtype: str
    model: str
    torch: str
    grid: list[int]  # B values, ascending
    contexts: list[int]  # C values, ascending
    measured: dict[str, list[float]]  # str(C) -> median steps/s per grid point, raw (JSON key "sps")
    spread: dict[str, list[float]] = field(default_factory=dict)  # str(C) -> IQR of steps/s
    row_tokens: int = 8
    repeats: int = 0
    warmup: int = 0
    measures: str = "forward"  # "forward": target forwards; "step": whole speculative steps (profile --drafter, SGLang)
    block_size: int = 0  # γ of a "step" table (0: not recorded)
    max_tokens: int = 0  # SGLang's max_batch_tokens, when read from its table (0: none)
    source: str = ""  # the file it was read from (for messages)

    def __post_init__(self) -> None:
        rows = [self.measured[str(c)] for c in self.contexts]
        step_time = 1.0 / torch.tensor(rows, dtype=torch.float64)  # [C, G]
        self._time = torch.stack([isotonic(row) for row in step_time])  # monotone cleanup
        self._grid = torch.tensor(self.grid, dtype=torch.float64)
        self._curves: dict = {}

    # -- lookups -------------------------------------------------------------------------------
    def step_time(self, tokens: torch.Tensor, context: float | None = None) -> torch.Tensor:
        """Seconds per forward for token counts ``tokens`` [...] (>= 1), cleaned and interpolated."""
        b = tokens.double().cpu()
        per_context = torch.stack([self._interp_b(row, b) for row in self._time])  # [C, ...]
        if context is None:
            return per_context.mean(0)
        if len(self.contexts) == 1:
            return per_context[0]
        ctx = torch.tensor(self.contexts, dtype=torch.float64)
        c = torch.tensor(float(context), dtype=torch.float64).clamp(ctx[0], ctx[-1])
        hi = int(torch.searchsorted(ctx, c).clamp(1, len(ctx) - 1))
        return torch.lerp(per_context[hi - 1], per_context[hi], (c - ctx[hi - 1]) / (ctx[hi] - ctx[hi - 1]))

    def _interp_b(self, row: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Step time of one context's cleaned row [G] at token counts b [...]."""
        g = self._grid
        inside_b = b.clamp(float(g[0]), float(g[-1]))
        if len(g) == 1:
            inside = row[0].expand_as(b)
        else:
            hi = torch.searchsorted(g, inside_b).clamp(1, len(g) - 1)
            lo = hi - 1
            inside = torch.lerp(row[lo], row[hi], (inside_b - g[lo]) / (g[hi] - g[lo]))
        return torch.where(b > g[-1], row[-1] * b / g[-1], inside)

    def sps(self, tokens: int | float, context: float | None = None) -> float:
        """Steps per second of a forward of ``tokens`` new tokens (cleaned, interpolated)."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        return float(1.0 / self.step_time(torch.tensor(float(tokens)), context))

    def sps_curve(
        self, max_tokens: int, context: float | None = None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """SPS(B) indexed by B = 0..n, n >= max_tokens, float64 on ``device`` (entry 0 = SPS(1));
        cached per device and context (rounded to 16 tokens: schedulers ask every round)."""
        if context is not None:
            context = float(16 * round(context / 16))
        key = (context, str(device))
        curve = self._curves.get(key)
        if curve is None or curve.shape[0] <= max_tokens:
            n = max(max_tokens, 2 * (curve.shape[0] if curve is not None else 64))
            b = torch.arange(n + 1, dtype=torch.float64).clamp(min=1)
            curve = (1.0 / self.step_time(b, context)).to(device)
            self._curves[key] = curve
        return curve

    # -- provenance ----------------------------------------------------------------------------
    def check(
        self,
        *,
        device: torch.device | str | None = None,
        model: str | None = None,
        strict: bool = False,
    ) -> list[str]:
        """Problems if this table was profiled on another device (by name) or model.

        strict=True raises DspecError on the first; otherwise each is warned as
        :class:`CostTableMismatch` and returned.
        """
        where = self.source or "cost table"
        problems = []
        if device is not None and self.device_name:  # tables read from SGLang name no device
            here = device_name(device)
            if here != self.device_name:
                problems.append(f"{where} was profiled on {self.device_name!r}, this run uses {here!r}")
        if model is not None and self.model and model != self.model:
            problems.append(f"{where} was profiled for model {self.model!r}, this run uses {model!r}")
        if problems and strict:
            raise DspecError(problems[0])
        for p in problems:
            warnings.warn(p, CostTableMismatch, stacklevel=2)
        return problems

    # -- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        keys = ("device", "device_name", "dtype", "model", "torch", "grid", "contexts", "measured", "spread",
                "row_tokens", "repeats", "warmup", "measures", "block_size", "max_tokens")
        return {"sps" if k == "measured" else k: getattr(self, k) for k in keys}

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (atomically; ``-`` is stdout)."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, block_size: int | None = None, what: str = "--cost-table") -> CostTable:
        """A dspec cost table (:class:`CostTableRecord`), or an SGLang DSpark SPS table (its additive
        schema needs γ = ``block_size``; see :mod:`dspec_cli.core.sglang_sps`); errors start with
        ``what``, the path and the field."""
        raw = read_json(path, what)
        where = f"{what} {path}"
        if isinstance(raw, dict) and sglang_sps.sps_schema(raw) is not None:
            return cls(**sglang_sps.cost_table_fields(raw, where, block_size))
        rec = validate(CostTableRecord, raw, where)
        return cls(**{k: getattr(rec, k) for k in CostTableRecord.model_fields if k != "sps"}, measured=rec.sps,
                   source=str(path))


class CostTableRecord(Record):
    """A dspec cost table file (``profile-hardware --json``; :meth:`CostTable.to_dict`)."""

    model_config = ConfigDict(extra="ignore")

    device: str
    device_name: str
    dtype: str
    model: str
    torch: str
    grid: list[PositiveInt] = Field(min_length=1)  # B values, strictly increasing
    contexts: list[Count] = Field(min_length=1)  # C values, strictly increasing
    sps: dict[str, list[PositiveFloat]]  # str(C) -> steps/s per grid point
    spread: dict[str, list[NonNegativeFloat]] = {}
    row_tokens: PositiveInt = 8
    repeats: Count = 0
    warmup: Count = 0
    measures: Literal["forward", "step"] = "forward"
    block_size: Count = 0
    max_tokens: Count = 0

    @model_validator(mode="after")
    def _one_row_per_context(self) -> CostTableRecord:
        for name in ("grid", "contexts"):
            values = getattr(self, name)
            if values != sorted(set(values)):
                raise ValueError(f"{name} must be strictly increasing, got {values}")
        for c in self.contexts:
            row = self.sps.get(str(c))
            if row is None or len(row) != len(self.grid):
                raise ValueError(f"sps[{c}] must list one value per grid point ({len(self.grid)})")
        return self
