"""SGLang DSpark's SPS cost tables (and the JSON writer of its side files).

Formats (SGLang ``python/sglang/srt/speculative/dspark_components/``, see docs/interop.md):

* STS (``dspark_sts.py``, ``--speculative-dspark-confidence-sts-path``):
  ``{"temperatures": [γ floats > 0], "dataset": "", "num_samples": 0, "ece_before": [],
  "ece_after": []}``; only ``temperatures`` is required and its length must equal the runtime γ.
  SGLang applies σ(raw_k / T_k) to the confidence head's raw output, as dspec does; dspec's
  :meth:`~dspec_cli.workflows.calibrate.Calibration.load` reads such a file like a calibration.json.
* SPS (``dspark_sps.py``, ``--speculative-dspark-sps-table-path``), one of
  - diagonal: ``{"sample_batch_tokens": [strictly increasing ints >= 1],
    "sample_steps_per_sec": [...], "max_batch_tokens": N}``, read as a floor lookup;
  - additive: ``{"bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"}``,
    step time = bias + interp(alpha, requests) + interp(theta, requests + budget), both
    interpolations linear and clamped; SGLang picks this schema when ``"bias_seconds"`` is present.
  B (the tokens of a step) counts every verified token, anchors included, as dspec's B does,
  and the steps are whole DSpark steps (drafting, verification, host work).
* STS collection shards (``SGLANG_DSPARK_STS_COLLECT_PATH=<stem>`` writes ``<stem>.N.pt``): a
  dict of ``logits`` (the confidence head's raw output) and ``prefix_mask`` (1 where the draft
  at that position and all before it matched the target), both [n, γ] float32.

A dspec :class:`~dspec_cli.core.hardware.CostTable` moves both ways: :func:`to_sglang_diagonal`
writes its (cleaned, context-averaged) curve; :func:`cost_table_fields` reads either
SGLang schema (an additive table along its diagonal, requests = B / (γ + 1), which needs γ).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from pydantic import ConfigDict, Field, model_validator

from dspec_cli.core.errors import DspecError
from dspec_cli.core.records import PositiveFloat, PositiveInt, Record, validate

SPS_FILE = "dspark_sps.json"
DIAGONAL_FIELDS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")
ADDITIVE_FIELDS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")


# --------------------------------------------------------------------------------------
# STS temperatures
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# SPS tables
# --------------------------------------------------------------------------------------


def sps_schema(raw: dict) -> str | None:
    """"additive", "diagonal" or None (not an SGLang table), by SGLang's own test."""
    if "bias_seconds" in raw:
        return "additive"
    return "diagonal" if "sample_batch_tokens" in raw else None


class DiagonalTable(Record):
    """SGLang's diagonal SPS table: steps/s at increasing token counts, read as a floor lookup."""

    model_config = ConfigDict(extra="ignore")

    sample_batch_tokens: list[PositiveInt] = Field(min_length=1)
    sample_steps_per_sec: list[PositiveFloat] = Field(min_length=1)
    max_batch_tokens: PositiveInt

    @model_validator(mode="after")
    def _shape(self) -> DiagonalTable:
        xs = self.sample_batch_tokens
        if xs != sorted(set(xs)):
            raise ValueError("sample_batch_tokens must be strictly increasing integers >= 1")
        if len(self.sample_steps_per_sec) != len(xs):
            raise ValueError(f"sample_steps_per_sec must hold one positive number per probe ({len(xs)})")
        if self.max_batch_tokens < xs[-1]:
            raise ValueError(f"max_batch_tokens must be an integer >= the largest probe ({xs[-1]})")
        return self


class AdditiveTable(Record):
    """SGLang's additive SPS table: bias + alpha(requests) + theta(tokens), seconds per step."""

    model_config = ConfigDict(extra="ignore")

    bias_seconds: PositiveFloat
    bs_probes: list[PositiveInt] = Field(min_length=1)
    alpha_seconds: list[float] = Field(min_length=1)
    m_probes: list[PositiveInt] = Field(min_length=1)
    theta_seconds: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> AdditiveTable:
        for probes, values in (("bs_probes", "alpha_seconds"), ("m_probes", "theta_seconds")):
            xs = getattr(self, probes)
            if xs != sorted(set(xs)):
                raise ValueError(f"{probes} must be strictly increasing integers >= 1")
            if len(getattr(self, values)) != len(xs):
                raise ValueError(f"{values} must hold one number per entry of {probes}")
        return self


def check_sps(raw: dict, where: str) -> str:
    """The schema of an SGLang SPS table dict, validated as its record (:class:`DiagonalTable`,
    :class:`AdditiveTable`); DspecError naming the field SGLang would refuse."""
    schema = sps_schema(raw)
    fields = ADDITIVE_FIELDS if schema == "additive" else DIAGONAL_FIELDS
    missing = [k for k in fields if k not in raw]
    if schema is None or missing:
        raise DspecError(f"{where}: missing key(s) {', '.join(missing or DIAGONAL_FIELDS)}")
    validate(AdditiveTable if schema == "additive" else DiagonalTable, raw, where)
    return schema


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation, clamped at both ends (SGLang's additive lookup)."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    hi = bisect.bisect_right(xs, x)
    return ys[hi - 1] + (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1]) * (ys[hi] - ys[hi - 1])


def additive_step_time(raw: dict, requests: float, tokens: float) -> float:
    """Seconds of a step of ``requests`` rows verifying ``tokens`` tokens in all (anchors included)."""
    return (raw["bias_seconds"] + _interp(raw["bs_probes"], raw["alpha_seconds"], requests)
            + _interp(raw["m_probes"], raw["theta_seconds"], tokens))


def cost_table_fields(raw: dict, where: str, block_size: int | None = None) -> dict:
    """The fields of a dspec CostTable (one context, ``measures = "step"``) from an SGLang SPS table dict.

    A diagonal table keeps its probes and numbers. An additive one is read along its diagonal
    (every request verifying γ drafts: requests = B / (γ + 1)) at B = its token probes and
    requests · (γ + 1) for its request probes, so it needs ``block_size`` γ. Who made the table
    is not recorded in SGLang's files: device and model are left empty (not checked).
    """
    schema = check_sps(raw, where)
    extra = {}
    if schema == "diagonal":
        grid, sps = list(raw["sample_batch_tokens"]), [float(v) for v in raw["sample_steps_per_sec"]]
        extra["max_tokens"] = raw["max_batch_tokens"]
    else:
        if block_size is None:
            raise DspecError(f"{where}: an SGLang additive table prices requests and tokens apart; reading it "
                             "needs the block size γ (--block-size)")
        width = block_size + 1
        grid = sorted(set(raw["m_probes"]) | {r * width for r in raw["bs_probes"]})
        times = [additive_step_time(raw, b / width, b) for b in grid]
        if min(times) <= 0:
            raise DspecError(f"{where}: the additive table gives a step time <= 0 at B = {grid[times.index(min(times))]}")
        sps = [1.0 / t for t in times]
        extra["block_size"] = block_size
    return dict(device="", device_name="", dtype="", model="", torch="", grid=grid, contexts=[0],
                measured={"0": sps}, measures="step", source=where, **extra)


def to_sglang_diagonal(table) -> dict:
    """SGLang's diagonal table of a dspec CostTable: its grid and the cleaned (monotone) steps/s,
    averaged over contexts in step time. A one-context table that cleaning leaves unchanged (any
    table read from SGLang) keeps its measured numbers exactly, so a table moves both ways."""
    grid = list(table.grid)
    raw = table.measured[str(table.contexts[0])]
    cleaned = 1.0 / table.step_time(torch.tensor(grid, dtype=torch.float64))
    unchanged = len(table.contexts) == 1 and torch.allclose(cleaned, torch.tensor(raw, dtype=torch.float64),
                                                            rtol=1e-12, atol=0.0)
    sps = [float(v) for v in raw] if unchanged else cleaned.tolist()
    return {"sample_batch_tokens": grid, "sample_steps_per_sec": sps,
            "max_batch_tokens": max(int(table.max_tokens), grid[-1])}


def fit_additive(cells: Sequence[tuple[int, int, float]], where: str = "profile") -> dict:
    """SGLang's additive table from measured cells (requests R, verified tokens M, seconds).

    Least squares of T = bias + alpha(R) + theta(M) with alpha one value per profiled R and theta
    piecewise linear (the lookup SGLang does) on probes at the smallest M and at every R·max
    tokens-per-request; alpha and theta are 0 at their first probe. Needs at least two
    verify widths per R (otherwise alpha and theta cannot be told apart).
    """
    requests = sorted({r for r, _, _ in cells})
    per_row = {r: max(m for rr, m, _ in cells if rr == r) // r for r in requests}
    if any(len({m for rr, m, _ in cells if rr == r}) < 2 for r in requests):
        raise DspecError(f"{where}: the additive table needs at least two --verify-tokens values per request count")
    probes = sorted({min(m for _, m, _ in cells)} | {r * per_row[r] for r in requests})
    rows = []
    for r, m, _ in cells:
        alpha = [float(r == q) for q in requests[1:]]
        hat = torch.zeros(len(probes), dtype=torch.float64)
        hi = min(max(bisect.bisect_left(probes, m), 1), len(probes) - 1) if len(probes) > 1 else 0
        if len(probes) == 1 or m <= probes[0]:
            hat[0] = 1.0
        else:
            frac = min((m - probes[hi - 1]) / (probes[hi] - probes[hi - 1]), 1.0)
            hat[hi - 1], hat[hi] = 1.0 - frac, frac
        rows.append([1.0, *alpha, *hat[1:].tolist()])
    design = torch.tensor(rows, dtype=torch.float64)  # [cells, 1 + (|R| - 1) + (|M| - 1)]
    target = torch.tensor([[t] for _, _, t in cells], dtype=torch.float64)
    beta = torch.linalg.lstsq(design, target, driver="gelsd").solution[:, 0].tolist()
    bias, k = beta[0], len(requests) - 1
    if not bias > 0:
        raise DspecError(f"{where}: the additive fit gives bias_seconds = {bias:.3g} <= 0 (SGLang refuses it); "
                         "profile more request counts or write --format sglang-diagonal")
    return {"bias_seconds": bias, "bs_probes": requests, "alpha_seconds": [0.0, *beta[1:1 + k]],
            "m_probes": probes, "theta_seconds": [0.0, *beta[1 + k:]]}


# --------------------------------------------------------------------------------------
# STS collection shards
# --------------------------------------------------------------------------------------


