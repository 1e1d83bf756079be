"""Confidence calibration (DSpark §3.2.1): metrics of prefix-survival predictions, Sequential
Temperature Scaling (STS), the survival map, and their held-out check.

A drafter's confidence c_k estimates P(x_k accepted | x_<k accepted), so the chance that
a round's accepted prefix reaches position k is the cumulative product Π_{j≤k} c_j. Every
metric here is computed per position k on exactly that prediction, over the rounds that
verified position k, against the label "accepted ≥ k" (as DeepSpec's evaluator does):

* ECE: 20 equal-width bins, Σ_bin |mean prediction − mean label| · count / total;
* AUROC: Mann–Whitney U with ties counted ½ (None when only one class occurs);
* Brier: mean squared error.

Two fits per verification rule, both on *raw* confidences (``calibration.json`` stores them
with the drafter name, block size and rule they belong to):

* STS, one temperature per position, left to right: c_k ← σ(logit(c_k) / T_k), T_k from a
  1-D grid minimising the ECE of the cumulative product with T_1..T_{k−1} already fixed;
* the survival map (what dspec applies): per position k a logistic regression of the label
  "accepted ≥ k" on logit(Π_{j≤k} c_j), s_k = σ(slope_k · logit + offset_k), by maximum
  likelihood (:func:`fit_survival`).

Held-out figures come from k-fold cross-fitting over prompts (:func:`heldout_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspec_cli.core.calibration import (
    CONFIDENCE_EPS,
    RULES,
    Calibration,
    RuleFit,
    apply_temperatures,
)
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
FOLDS = 5  # held-out metrics: k-fold cross-fitting
SURVIVAL_PRIOR = 1.0  # weight of the survival map's pull towards the raw product (slope 1, offset 0)


# --------------------------------------------------------------------------------------
# Per-round records
# --------------------------------------------------------------------------------------


@dataclass
class Rounds:
    """Verification rounds: confidences of the verified positions and the accepted count."""

    confidence: torch.Tensor  # [N, γ] float64 in (0, 1); 0.5 past `verified`
    verified: torch.Tensor  # [N] long: positions with a confidence (ℓ of the round)
    accepted: torch.Tensor  # [N] long: accepted drafts, 0 <= accepted <= verified
    prompt: torch.Tensor | None = None  # [N] long: the prompt (request) each round belongs to; None: not known

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
        prompts: Sequence[int] | None = None,
    ) -> Rounds:
        """Validate and pack records; ``where`` names each record in error messages, ``prompts``
        gives each record's prompt index (None: not known)."""
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
        prompt = None if prompts is None else torch.tensor(list(prompts), dtype=torch.long)
        return cls(table, verified, torch.tensor(list(accepted), dtype=torch.long), prompt)

    @classmethod
    def from_results(cls, results: Iterable, block_size: int) -> Rounds:
        """Rounds with at least one verified draft from engine ``RequestResult``s.

        Confidences are clamped into (1e-6, 1 − 1e-6): a float32 sigmoid can round to 0 or 1.
        """
        confs: list[list[float]] = []
        accepted: list[int] = []
        prompts: list[int] = []
        for res in results:
            for conf, acc in zip(res.confidence, res.accepted, strict=False):  # a round without drafts has []
                if conf:
                    confs.append([min(max(float(c), CONFIDENCE_EPS), 1 - CONFIDENCE_EPS) for c in conf])
                    accepted.append(int(acc))
                    prompts.append(res.index)
        return cls.from_lists(confs, accepted, block_size=block_size, prompts=prompts)

    def select(self, index: torch.Tensor) -> Rounds:
        """Rounds ``index`` [M] (with repetition)."""
        prompt = None if self.prompt is None else self.prompt[index]
        return Rounds(self.confidence[index], self.verified[index], self.accepted[index], prompt)

    def with_confidence(self, confidence: torch.Tensor) -> Rounds:
        """The same rounds with other confidences [N, γ]."""
        return Rounds(confidence, self.verified, self.accepted, self.prompt)

    def with_temperatures(self, temperatures: Sequence[float] | None) -> Rounds:
        return self.with_confidence(apply_temperatures(self.confidence, temperatures))

    def calibrated(self, fit: RuleFit) -> Rounds:
        """The rounds with ``fit`` applied to their (raw) confidences, as the engine applies it."""
        return self.with_confidence(fit.apply(self.confidence))


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


def ece_floor(rounds: Rounds, draws: int = 20, seed: int = 0, bins: int = NUM_BINS) -> float | None:
    """The count-weighted mean ECE that perfectly calibrated predictions show on rounds like
    these: outcomes drawn ``draws`` times from the rounds' own survival predictions Π c (one
    uniform per round, accepted ≥ k while it is below Π_{j≤k} c_j); the sampling noise under which
    no fit's ECE can go on this many rounds. None without verified positions."""
    pred, _, mask = survival_labels(rounds)
    counts = mask.sum(0)
    if int(counts.sum()) == 0:
        return None
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(draws):
        label = torch.rand(len(rounds), 1, generator=g, dtype=torch.float64) < pred
        total += sum(ece(pred[mask[:, k], k], label[mask[:, k], k], bins) * int(n)
                     for k, n in enumerate(counts) if n)
    return total / draws / int(counts.sum())


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
# The survival map
# --------------------------------------------------------------------------------------


def _logistic(x: torch.Tensor, y: torch.Tensor, prior: float, iters: int = 50) -> tuple[float, float]:
    """(slope, offset) maximising Σ log-likelihood of y [n] under σ(slope · x + offset) for x [n],
    minus prior/2 · ((slope − 1)² + offset²), by Newton's method."""
    X = torch.stack([x, torch.ones_like(x)], 1)
    anchor = torch.tensor([1.0, 0.0], dtype=torch.float64)
    w = anchor.clone()
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        grad = X.T @ (p - y) + prior * (w - anchor)
        hess = (X * (p * (1 - p))[:, None]).T @ X + prior * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    return float(w[0]), float(w[1])


def fit_survival(rounds: Rounds, prior: float = SURVIVAL_PRIOR) -> tuple[list[float], list[float]]:
    """The survival map's (slope [γ], offset [γ]): per position k, a logistic regression of
    "accepted ≥ k" on logit(Π_{j≤k} c_j) over the rounds that verified k, with a Gaussian prior of
    weight ``prior`` pulling towards the raw product (slope 1, offset 0), which positions with few
    or one-sided rounds keep. A negative slope (confidence that ranks backwards) becomes 0 and
    the offset the logit of the label's mean there."""
    _, label, mask = survival_labels(rounds)
    c = rounds.confidence.double().clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS)
    log_a = c.log().cumsum(1)
    logit_a = log_a - torch.log(-torch.expm1(log_a))  # [N, γ]
    slopes, offsets = [], []
    for k in range(rounds.block_size):
        m = mask[:, k]
        x, y = logit_a[m, k], label[m, k].double()
        slope, offset = _logistic(x, y, prior) if x.numel() else (1.0, 0.0)
        if slope < 0:
            mean = float((y.sum() + 0.5) / (y.numel() + 1))
            slope, offset = 0.0, float(torch.logit(torch.tensor(mean)))
        slopes.append(slope)
        offsets.append(offset)
    return slopes, offsets


def fit_rule(rounds: Rounds, grid: Sequence[float] = DEFAULT_GRID) -> RuleFit:
    """STS temperatures and the survival map fitted on raw-confidence rounds (no metrics)."""
    slope, offset = fit_survival(rounds)
    return RuleFit(fit_sts(rounds, grid), slope, offset)


def folds(rounds: Rounds, k: int = FOLDS) -> tuple[torch.Tensor, str]:
    """(fold index [N] of each round, the split's name): prompts dealt round-robin into ``k``
    folds when the rounds name at least ``k`` prompts, else ``k`` contiguous blocks of rounds."""
    n = len(rounds)
    if rounds.prompt is not None and int(torch.unique(rounds.prompt).numel()) >= k:
        _, rank = torch.unique(rounds.prompt, return_inverse=True)
        return rank % k, f"{k}-fold over prompts"
    return torch.arange(n) * k // max(n, 1), f"{k} contiguous blocks of rounds (prompts not recorded)"


def heldout_metrics(rounds: Rounds, k: int = FOLDS, grid: Sequence[float] = DEFAULT_GRID) -> dict:
    """Cross-fitted metrics: every round is scored by the fit (STS and the survival map) of the
    other ``k − 1`` folds (:func:`folds`); {"split", "sts", "after"} with position metrics."""
    fold, split = folds(rounds, k)
    sts = rounds.confidence.clone()
    mapped = rounds.confidence.clone()
    for f in range(k):
        test, train = fold == f, fold != f
        if not bool(test.any()) or not bool(train.any()):
            continue
        fit = fit_rule(rounds.select(train.nonzero().squeeze(1)), grid)
        sts[test] = apply_temperatures(rounds.confidence[test], fit.temperatures)
        mapped[test] = fit.apply(rounds.confidence[test])
    return {"split": split, "sts": position_metrics(rounds.with_confidence(sts)),
            "after": position_metrics(rounds.with_confidence(mapped))}


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


def save_traces(path: str | Path, rounds: Rounds, *, drafter: str, block_size: int, verify: str) -> None:
    """One JSON line per round: {"drafter", "block_size", "verify", "prompt" (when known),
    "confidence": [...], "accepted"}; ``verify`` is the rule the rounds were verified by."""
    def line(i: int) -> dict:
        obj = {"drafter": drafter, "block_size": block_size, "verify": verify}
        if rounds.prompt is not None:
            obj["prompt"] = int(rounds.prompt[i])
        return {**obj, "confidence": rounds.confidence[i, : int(rounds.verified[i])].tolist(),
                "accepted": int(rounds.accepted[i])}

    write_jsonl(path, (line(i) for i in range(len(rounds))))


def load_traces(path: str | Path) -> tuple[Rounds, dict]:
    """Read a trace file: (rounds, {"drafter", "block_size", "verify"}), each the same on every
    line that has it: rounds verified by different rules do not mix. ``verify`` is None for
    traces that do not record it; prompts are known when every line names one."""
    confs, accepted, where, prompts = [], [], [], []
    meta: dict = {}
    for loc, obj in jsonl_objects(path, kind="traces"):
        if not isinstance(obj.get("confidence"), list) or "accepted" not in obj:
            raise DspecError(f"{loc}: expected {{\"confidence\": [...], \"accepted\": n}}")
        for key in ("drafter", "block_size", "verify"):
            if key in obj:
                if meta.setdefault(key, obj[key]) != obj[key]:
                    mixed = ": rounds verified by different rules do not mix" if key == "verify" else ""
                    raise DspecError(f"{loc}: {key} {obj[key]!r} differs from earlier lines ({meta[key]!r}){mixed}")
        prompt = obj.get("prompt")
        if prompt is not None and (not isinstance(prompt, int) or isinstance(prompt, bool)):
            raise DspecError(f"{loc}: prompt must be an integer, got {prompt!r}")
        confs.append(obj["confidence"])
        accepted.append(obj["accepted"])
        where.append(loc)
        prompts.append(prompt)
    if not confs:
        raise DspecError(f"traces {path}: no records")
    block_size = meta.get("block_size")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise DspecError(f"traces {path}: block_size must be a positive integer, got {block_size!r}")
    if meta.get("verify", RULES[0]) not in RULES:
        raise DspecError(f"traces {path}: verify must be one of {', '.join(RULES)}, got {meta['verify']!r}")
    known = None if any(p is None for p in prompts) else prompts
    rounds = Rounds.from_lists(confs, accepted, block_size=block_size, where=where, prompts=known)
    return rounds, {"drafter": meta.get("drafter", ""), "block_size": rounds.block_size, "verify": meta.get("verify")}


# --------------------------------------------------------------------------------------
# Collecting rounds and fitting
# --------------------------------------------------------------------------------------


def collect_rounds(target, drafter, prompts: Sequence[Sequence[int]], config, on_finish=None) -> tuple[Rounds, str]:
    """Run ``drafter`` with the fixed scheduler (ℓ = lmax) over prompt ids: (every round with
    drafts, the chain rule that verified them). That rule is ``config.chain_verify`` unless the
    drafts carry no draft probabilities (then the engine verifies token by token) or decoding is
    greedy (where both rules are greedy matching: the configured one is recorded).

    Confidences are recorded raw: the drafter's calibration is switched off for the run.
    """
    calibration, drafter.calibration = drafter.calibration, None
    engine = SpeculativeEngine(target, drafter, config)
    try:
        results = engine.generate(prompts, on_finish=on_finish)
    finally:
        drafter.calibration = calibration
    ran = {r: n for r, n in engine.stats.verify_rules.items() if r in RULES}
    rule = max(ran, key=lambda r: ran[r]) if ran else config.chain_verify
    return Rounds.from_results(results, drafter.config.block_size), rule


def record_rounds(target, drafter, prompts: Sequence[str], config, *, strict: bool = False,
                  progress: Callable[[int], Callable] | None = None,
                  chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> tuple[Rounds, str, int, int]:
    """Calibration data: render ``prompts`` with the chat template and ``chat_template_kwargs``
    (a warning when the drafter was trained under others), keep those that fit the target's
    context (:func:`~dspec_cli.workflows.bench.fitting_prompts`), and record their rounds raw
    under ``config.chain_verify`` (:func:`collect_rounds`). Returns (rounds, the rule that verified
    them, prompts used, prompts skipped as too long); ``progress(total)`` returns a per-request
    callback."""
    warn_if_other_kwargs(drafter, chat_template_kwargs, target.tokenizer, calibration=False)  # refitted here
    rendered = [target.render_prompt(p, chat_template_kwargs) for p in prompts]
    ids, skipped = fitting_prompts(target, rendered, config.max_new_tokens, config.block_size, strict=strict,
                                   where="--dataset")
    on_finish = progress(len(ids)) if progress else None
    rounds, rule = collect_rounds(target, drafter, ids, config, on_finish=on_finish)
    return rounds, rule, len(ids), skipped


def evaluate(fit: RuleFit, rounds: Rounds) -> dict:
    """Metrics of a fit on raw-confidence rounds: {"before", "sts", "after"} position metrics (raw,
    its temperatures, what it applies) and "floor", the ECE that perfectly calibrated predictions
    would show on these rounds (:func:`ece_floor`)."""
    applied = rounds.calibrated(fit)
    return {"before": position_metrics(rounds), "sts": position_metrics(rounds.with_temperatures(fit.temperatures)),
            "after": position_metrics(applied), "floor": ece_floor(applied)}


def calibrate(rounds: Rounds, drafter: str, rule: str = RULES[0], grid: Sequence[float] = DEFAULT_GRID,
              chat_template_kwargs: Mapping[str, Any] | None = None, heldout: bool = True) -> Calibration:
    """Fit STS and the survival map on raw-confidence rounds verified by ``rule`` (of prompts
    rendered with ``chat_template_kwargs``; None: not known). The fit's metrics: in-sample
    "before" (raw), "sts" and "after" (the survival map), and (``heldout``) the k-fold
    cross-fitted ones (:func:`heldout_metrics`)."""
    if len(rounds) == 0:
        raise DspecError("no verified drafts were recorded: use more prompts or a larger --max-new-tokens")
    if rule not in RULES:
        raise DspecError(f"--verify must be one of {', '.join(RULES)}, got {rule!r}")
    fit = fit_rule(rounds, grid)
    fit.metrics = evaluate(fit, rounds)
    if heldout:
        fit.metrics["heldout"] = heldout_metrics(rounds, grid=grid)
    kwargs = None if chat_template_kwargs is None else dict(chat_template_kwargs)
    return Calibration(drafter, rounds.block_size, {rule: fit}, chat_template_kwargs=kwargs)
