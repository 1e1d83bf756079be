"""Confidence calibration (DSpark §3.2.1): metrics of prefix-survival predictions and
Sequential Temperature Scaling (STS).

A drafter's confidence c_k estimates P(x_k accepted | x_<k accepted), so the chance that
a round's accepted prefix reaches position k is the cumulative product Π_{j≤k} c_j. Every
metric here is computed per position k on exactly that prediction, over the rounds that
verified position k, against the label "accepted ≥ k" (as DeepSpec's evaluator does):

* ECE: 20 equal-width bins, Σ_bin |mean prediction − mean label| · count / total;
* AUROC: Mann–Whitney U with ties counted ½ (None when only one class occurs);
* Brier: mean squared error.

STS fits one temperature per position, left to right: c_k ← σ(logit(c_k) / T_k), T_k from a
1-D grid minimising the ECE of the cumulative product with T_1..T_{k−1} already fixed.
Temperatures always apply to *raw* confidences; ``calibration.json`` stores them with the
drafter name and block size they belong to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspec_cli.core.calibration import Calibration, apply_temperatures
from dspec_cli.core.chat_template import DEFAULT_KWARGS
from dspec_cli.core.data import jsonl_objects
from dspec_cli.core.errors import DspecError
from dspec_cli.core.jsonl import write_jsonl
from dspec_cli.runtime.drafter import warn_if_other_kwargs
from dspec_cli.runtime.engine import SpeculativeEngine
from dspec_cli.workflows.bench import fitting_prompts

NUM_BINS = 20
DEFAULT_GRID = tuple(sorted({round(10 ** (i / 80), 6) for i in range(-104, 105)}))  # 0.05 … 20, log-spaced, with 1.0
SWEEP_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))  # the paper's Fig. 5: 0.0 … 0.9
CONFIDENCE_EPS = 1e-6  # recorded confidences are clamped into (eps, 1 − eps): σ saturates in float32


# --------------------------------------------------------------------------------------
# Per-round records
# --------------------------------------------------------------------------------------


@dataclass
class Rounds:
    """Verification rounds: confidences of the verified positions and the accepted count."""

    confidence: torch.Tensor  # [N, γ] float64 in (0, 1); 0.5 past `verified`
    verified: torch.Tensor  # [N] long: positions with a confidence (ℓ of the round)
    accepted: torch.Tensor  # [N] long: accepted drafts, 0 <= accepted <= verified

    def __len__(self) -> int:
        return self.verified.shape[0]

    @property
    def block_size(self) -> int:
        return self.confidence.shape[1]

    @classmethod
    def from_lists(
        cls,
        confidences: Sequence[Sequence[float]],
        accepted: Sequence[int],
        *,
        block_size: int | None = None,
        where: Sequence[str] | None = None,
    ) -> Rounds:
        """Validate and pack records; ``where`` names each record in error messages."""
        if len(confidences) != len(accepted):
            raise DspecError(f"got {len(confidences)} confidence lists but {len(accepted)} accepted counts")
        gamma = block_size if block_size is not None else max((len(c) for c in confidences), default=0)
        for i, (conf, acc) in enumerate(zip(confidences, accepted, strict=True)):
            name = where[i] if where is not None else f"record {i}"
            if len(conf) > gamma:
                raise DspecError(f"{name}: {len(conf)} confidences for block size {gamma}")
            bad = [c for c in conf if not (isinstance(c, (int, float)) and 0.0 < c < 1.0)]
            if bad:
                raise DspecError(f"{name}: confidence values must lie in (0, 1), got {bad[0]!r}")
            if not isinstance(acc, int) or isinstance(acc, bool) or not 0 <= acc <= len(conf):
                raise DspecError(f"{name}: accepted must be an integer in [0, {len(conf)}], got {acc!r}")
        n = len(confidences)
        table = torch.full((n, gamma), 0.5, dtype=torch.float64)
        verified = torch.tensor([len(c) for c in confidences], dtype=torch.long)
        if n and gamma:
            flat = torch.tensor([c for conf in confidences for c in conf], dtype=torch.float64)
            table[torch.arange(gamma) < verified[:, None]] = flat
        return cls(table, verified, torch.tensor(list(accepted), dtype=torch.long))

    @classmethod
    def from_results(cls, results: Iterable, block_size: int) -> Rounds:
        """Rounds with at least one verified draft from engine ``RequestResult``s.

        Confidences are clamped into (1e-6, 1 − 1e-6): a float32 sigmoid can round to 0 or 1.
        """
        confs: list[list[float]] = []
        accepted: list[int] = []
        for res in results:
            # confidences exist for drafted rounds only; with the fixed scheduler the rounds without
            # a draft are a request's last ones (no token budget left), so zip stops before them
            for conf, acc in zip(res.confidence, res.accepted, strict=False):
                if conf:
                    confs.append([min(max(float(c), CONFIDENCE_EPS), 1 - CONFIDENCE_EPS) for c in conf])
                    accepted.append(int(acc))
        return cls.from_lists(confs, accepted, block_size=block_size)

    def select(self, index: torch.Tensor) -> Rounds:
        """Rounds ``index`` [M] (with repetition)."""
        return Rounds(self.confidence[index], self.verified[index], self.accepted[index])

    def with_temperatures(self, temperatures: Sequence[float] | None) -> Rounds:
        return Rounds(apply_temperatures(self.confidence, temperatures), self.verified, self.accepted)


def survival_labels(rounds: Rounds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prediction Π_{j≤k} c_j [N, γ], label accepted ≥ k [N, γ] bool, mask verified ≥ k [N, γ] bool)."""
    k = torch.arange(rounds.block_size)
    return rounds.confidence.cumprod(1), k < rounds.accepted[:, None], k < rounds.verified[:, None]


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def _bin_sums(pred: torch.Tensor, label: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-bin (count, Σ prediction, Σ label) for pred [G, n] against label [n]: each [G, bins]."""
    idx = (pred * bins).long().clamp(0, bins - 1)
    zeros = torch.zeros(pred.shape[0], bins, dtype=torch.float64)
    count = zeros.scatter_add(1, idx, torch.ones_like(pred, dtype=torch.float64))
    sum_pred = zeros.scatter_add(1, idx, pred.double())
    sum_label = zeros.scatter_add(1, idx, label.double().expand_as(pred))
    return count, sum_pred, sum_label


def ece_many(pred: torch.Tensor, label: torch.Tensor, bins: int = NUM_BINS) -> torch.Tensor:
    """ECE of each row of pred [G, n] against label [n] (equal-width bins, count-weighted): [G]."""
    _, sum_pred, sum_label = _bin_sums(pred, label, bins)
    return (sum_pred - sum_label).abs().sum(1) / pred.shape[1]


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = NUM_BINS) -> float:
    """Expected calibration error of predictions [n] against binary labels [n]."""
    if pred.numel() == 0:
        raise ValueError("ece needs at least one prediction")
    return float(ece_many(pred.reshape(1, -1), label.reshape(-1), bins)[0])


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float | None:
    """Area under the ROC curve (Mann–Whitney U, ties count ½); None if one class is missing."""
    label = label.bool().reshape(-1)
    n_pos = int(label.sum())
    n_neg = label.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = torch.unique(pred.reshape(-1).double(), return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mid_rank = ends - (counts.double() - 1) / 2  # average 1-based rank of each tied group
    u = mid_rank[inverse][label].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.double() - label.double()) ** 2).mean())


def position_metrics(rounds: Rounds, bins: int = NUM_BINS) -> dict:
    """Per-position lists (index k−1): count, ece, auroc, brier, mean_pred, mean_label; plus the
    count-weighted means ``ece_mean`` and ``brier_mean``. Positions nobody verified give None."""
    pred, label, mask = survival_labels(rounds)
    out: dict = {key: [] for key in ("count", "ece", "auroc", "brier", "mean_pred", "mean_label")}
    for k in range(rounds.block_size):
        p, y = pred[mask[:, k], k], label[mask[:, k], k]
        n = p.numel()
        out["count"].append(n)
        out["ece"].append(ece(p, y, bins) if n else None)
        out["auroc"].append(auroc(p, y) if n else None)
        out["brier"].append(brier(p, y) if n else None)
        out["mean_pred"].append(float(p.mean()) if n else None)
        out["mean_label"].append(float(y.double().mean()) if n else None)
    total = sum(out["count"])
    for key in ("ece", "brier"):
        out[f"{key}_mean"] = (
            sum(v * n for v, n in zip(out[key], out["count"], strict=True) if v is not None) / total if total else None
        )
    return out


def reliability(rounds: Rounds, bins: int = NUM_BINS) -> list[dict]:
    """Reliability-diagram data per position: bin edges, counts, mean prediction and label per bin."""
    pred, label, mask = survival_labels(rounds)
    edges = [i / bins for i in range(bins + 1)]
    out = []
    for k in range(rounds.block_size):
        p, y = pred[mask[:, k], k], label[mask[:, k], k]
        count, sum_pred, sum_label = _bin_sums(p.reshape(1, -1), y, bins)
        safe = count[0].clamp(min=1)
        out.append({
            "position": k + 1,
            "edges": edges,
            "count": count[0].long().tolist(),
            "mean_pred": [float(v) if c else None for v, c in zip(sum_pred[0] / safe, count[0], strict=True)],
            "mean_label": [float(v) if c else None for v, c in zip(sum_label[0] / safe, count[0], strict=True)],
            "ece": ece(p, y, bins) if p.numel() else None,
            "auroc": auroc(p, y) if p.numel() else None,
        })
    return out


# --------------------------------------------------------------------------------------
# Sequential Temperature Scaling
# --------------------------------------------------------------------------------------


def fit_sts(rounds: Rounds, grid: Sequence[float] = DEFAULT_GRID, bins: int = NUM_BINS) -> list[float]:
    """Temperatures T_1..T_γ fitted left to right (earlier positions fixed) by grid search.

    Among grid values with the smallest ECE the one closest to 1 (in log scale) wins, so a
    position whose ECE no temperature improves keeps T = 1; unverified positions get 1.
    """
    grid_t = torch.tensor(sorted(grid), dtype=torch.float64)
    if grid_t.numel() == 0 or bool((grid_t <= 0).any()):
        raise ValueError("grid must hold positive temperatures")
    logits = torch.logit(rounds.confidence)  # [N, γ]
    _, label, mask = survival_labels(rounds)
    prefix = torch.ones(len(rounds), dtype=torch.float64)  # calibrated Π_{j<k} c_j
    chunk = max(1, 4_000_000 // max(len(rounds), 1))
    temps = []
    for k in range(rounds.block_size):
        m = mask[:, k]
        best = 1.0
        if bool(m.any()):
            base, z, y = prefix[m], logits[m, k], label[m, k]
            errs = torch.cat([
                ece_many(base * torch.sigmoid(z / g[:, None]), y, bins) for g in grid_t.split(chunk)
            ])
            ties = (errs <= errs.min() + 1e-12).nonzero().squeeze(1)
            best = float(grid_t[ties[grid_t[ties].log().abs().argmin()]])
        temps.append(best)
        prefix = prefix * torch.sigmoid(logits[:, k] / best)
    return temps


# --------------------------------------------------------------------------------------
# calibration.json
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# Threshold sweep (the paper's Fig. 5) and trace files
# --------------------------------------------------------------------------------------


def threshold_sweep(rounds: Rounds, thresholds: Sequence[float] = SWEEP_THRESHOLDS) -> list[dict]:
    """Offline static-threshold pruning: each round verifies its positions up to the first c_k < t.

    Per threshold: verified, accepted and rejected tokens per step (round) and the acceptance
    rate accepted / verified. Threshold 0 is fixed-length verification.
    """
    if len(rounds) == 0:
        raise DspecError("threshold sweep needs at least one round")
    k = torch.arange(rounds.block_size)
    in_range = k < rounds.verified[:, None]
    out = []
    for t in thresholds:
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"thresholds must lie in [0, 1], got {t}")
        kept = ((rounds.confidence >= t) & in_range).long().cumprod(1).sum(1)  # [N]
        acc = torch.minimum(rounds.accepted, kept)
        n, verified, accepted = len(rounds), int(kept.sum()), int(acc.sum())
        out.append({
            "threshold": float(t),
            "verified_per_step": verified / n,
            "accepted_per_step": accepted / n,
            "rejected_per_step": (verified - accepted) / n,
            "acceptance_rate": accepted / verified if verified else None,
        })
    return out


def save_traces(path: str | Path, rounds: Rounds, *, drafter: str, block_size: int) -> None:
    """One JSON line per round: {"drafter", "block_size", "confidence": [...], "accepted"}."""
    write_jsonl(path, (
        {"drafter": drafter, "block_size": block_size, "confidence": rounds.confidence[i, : int(rounds.verified[i])].tolist(),
         "accepted": int(rounds.accepted[i])}
        for i in range(len(rounds))
    ))


def load_traces(path: str | Path) -> tuple[Rounds, dict]:
    """Read a trace file: (rounds, {"drafter", "block_size"}) — both must agree across lines."""
    confs, accepted, where = [], [], []
    meta: dict = {}
    for loc, obj in jsonl_objects(path, kind="traces"):
        if not isinstance(obj.get("confidence"), list) or "accepted" not in obj:
            raise DspecError(f"{loc}: expected {{\"confidence\": [...], \"accepted\": n}}")
        for key in ("drafter", "block_size"):
            if key in obj:
                if meta.setdefault(key, obj[key]) != obj[key]:
                    raise DspecError(f"{loc}: {key} {obj[key]!r} differs from earlier lines ({meta[key]!r})")
        confs.append(obj["confidence"])
        accepted.append(obj["accepted"])
        where.append(loc)
    if not confs:
        raise DspecError(f"traces {path}: no records")
    block_size = meta.get("block_size")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise DspecError(f"traces {path}: block_size must be a positive integer, got {block_size!r}")
    rounds = Rounds.from_lists(confs, accepted, block_size=block_size, where=where)
    return rounds, {"drafter": meta.get("drafter", ""), "block_size": rounds.block_size}


# --------------------------------------------------------------------------------------
# Collecting rounds and fitting
# --------------------------------------------------------------------------------------


def collect_rounds(target, drafter, prompts: Sequence[Sequence[int]], config, on_finish=None) -> Rounds:
    """Run ``drafter`` with the fixed scheduler (ℓ = lmax) over prompt ids; every round with drafts.

    Confidences are recorded raw: the drafter's calibration is switched off for the run.
    """
    calibration, drafter.calibration = drafter.calibration, None
    try:
        results = SpeculativeEngine(target, drafter, config).generate(prompts, on_finish=on_finish)
    finally:
        drafter.calibration = calibration
    return Rounds.from_results(results, drafter.config.block_size)


def record_rounds(target, drafter, prompts: Sequence[str], config, *, strict: bool = False,
                  progress: Callable[[int], Callable] | None = None,
                  chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> tuple[Rounds, int, int]:
    """Calibration data: render ``prompts`` with the chat template and ``chat_template_kwargs``
    (a warning when the drafter was trained under others), keep those that fit the target's
    context (:func:`~dspec_cli.workflows.bench.fitting_prompts`), and record their rounds raw
    (:func:`collect_rounds`). Returns (rounds, prompts used, prompts skipped as too long);
    ``progress(total)`` returns a per-request callback."""
    warn_if_other_kwargs(drafter, chat_template_kwargs, target.tokenizer, calibration=False)  # refitted here
    rendered = [target.render_prompt(p, chat_template_kwargs) for p in prompts]
    ids, skipped = fitting_prompts(target, rendered, config.max_new_tokens, config.block_size, strict=strict,
                                   where="--dataset")
    on_finish = progress(len(ids)) if progress else None
    return collect_rounds(target, drafter, ids, config, on_finish=on_finish), len(ids), skipped


def calibrate(rounds: Rounds, drafter: str, grid: Sequence[float] = DEFAULT_GRID,
              chat_template_kwargs: Mapping[str, Any] | None = None) -> Calibration:
    """Fit STS on raw-confidence rounds (of prompts rendered with ``chat_template_kwargs``; None: not
    known); metrics before and after go into the result."""
    if len(rounds) == 0:
        raise DspecError("no verified drafts were recorded: use more prompts or a larger --max-new-tokens")
    temps = fit_sts(rounds, grid)
    metrics = {"before": position_metrics(rounds), "after": position_metrics(rounds.with_temperatures(temps))}
    kwargs = None if chat_template_kwargs is None else dict(chat_template_kwargs)
    return Calibration(drafter, rounds.block_size, temps, metrics, chat_template_kwargs=kwargs)
