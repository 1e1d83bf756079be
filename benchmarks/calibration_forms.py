"""Which calibration form fits a verification rule: candidate maps fitted on one trace file and
scored on another (not a test).

    python -m benchmarks.calibration_forms --fit FIT.jsonl --heldout HELDOUT.jsonl [--json PATH]

Both files are ``dspec calibrate --save-traces`` output of the same drafter and rule (raw
confidences). Every form maps raw confidences c_1..c_γ to a survival estimate s_k of
P(accepted ≥ k) and is scored by the count-weighted held-out ECE of s (dspec's metric,
docs/calibration.md), next to the floor a perfect fit shows on that many rounds:

- ``raw``: Π_{j≤k} c_j; ``sts``: DSpark's Sequential Temperature Scaling (§3.2.1);
- ``map``: dspec's survival map, σ(slope_k · logit Π c + offset_k) (:func:`fit_survival`);
- ``map+quad``: the same with (logit Π c)² as a third input; ``map+min``: with logit min_{j≤k} c_j;
- ``hazard``: a logistic fit of each c_k on the rounds that reached k − 1 (discrete hazard), Π;
- ``isotonic``: per position the monotone (pool-adjacent-violators) fit of the label on Π c.

Maps other than ``raw``/``sts`` are made non-increasing over k (running minimum), as dspec does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from dspec_cli.core.calibration import CONFIDENCE_EPS, apply_temperatures
from dspec_cli.workflows.calibrate import (
    Rounds,
    ece_floor,
    fit_sts,
    fit_survival,
    load_traces,
    position_metrics,
    survival_labels,
)


def _logit_products(rounds: Rounds) -> torch.Tensor:
    """logit(Π_{j≤k} c_j) [N, γ]."""
    log_a = rounds.confidence.clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS).log().cumsum(1)
    return log_a - torch.log(-torch.expm1(log_a))


def _logreg(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3, iters: int = 50) -> torch.Tensor:
    """Weights of a logistic regression of y [n] on x [n, d] (a bias column appended): [d + 1]."""
    X = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    w = torch.zeros(X.shape[1], dtype=x.dtype)
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        hess = (X * (p * (1 - p))[:, None]).T @ X + l2 * torch.eye(X.shape[1], dtype=x.dtype)
        w = w - torch.linalg.solve(hess, X.T @ (p - y) + l2 * w)
    return w


def _features(kind: str, rounds: Rounds, k: int) -> torch.Tensor:
    """Inputs of the ``map+quad`` / ``map+min`` regressions at position k: [N, 2]."""
    la = _logit_products(rounds)[:, k]
    if kind == "quad":
        return torch.stack([la, la**2 / 10], 1)
    low = rounds.confidence[:, : k + 1].min(1).values.clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS)
    return torch.stack([la, torch.logit(low)], 1)


def _monotone(s: torch.Tensor) -> torch.Tensor:
    return s.cummin(1).values


def form_regression(kind: str) -> Callable[[Rounds], Callable[[Rounds], torch.Tensor]]:
    def fit(train: Rounds):
        _, label, mask = survival_labels(train)
        ws = [_logreg(_features(kind, train, k)[mask[:, k]], label[mask[:, k], k].double()) for k in range(train.block_size)]

        def predict(rounds: Rounds) -> torch.Tensor:
            cols = [torch.sigmoid(_features(kind, rounds, k) @ ws[k][:-1] + ws[k][-1]) for k in range(rounds.block_size)]
            return _monotone(torch.stack(cols, 1))

        return predict

    return fit


def form_map(train: Rounds):
    slope, offset = (torch.tensor(v, dtype=torch.float64) for v in fit_survival(train))
    return lambda rounds: _monotone(torch.sigmoid(slope * _logit_products(rounds) + offset))


def form_sts(train: Rounds):
    temps = fit_sts(train)
    return lambda rounds: apply_temperatures(rounds.confidence, temps).cumprod(1)


def form_hazard(train: Rounds):
    ws = []
    for k in range(train.block_size):
        reached = (train.verified > k) & (train.accepted >= k)
        z = torch.logit(train.confidence[:, k].clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS))
        ws.append(_logreg(z[reached, None], (train.accepted[reached] > k).double()))

    def predict(rounds: Rounds) -> torch.Tensor:
        z = torch.logit(rounds.confidence.clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS))
        return torch.stack([torch.sigmoid(z[:, k] * w[0] + w[1]) for k, w in enumerate(ws)], 1).cumprod(1)

    return predict


def form_isotonic(train: Rounds):
    # scipy: a test dependency (this script is a development tool)
    from scipy.optimize import isotonic_regression

    pred, label, mask = survival_labels(train)
    tables = []
    for k in range(train.block_size):
        x, order = pred[mask[:, k], k].sort()
        y = isotonic_regression(label[mask[:, k], k][order].double().numpy()).x
        tables.append((x, torch.as_tensor(y)))

    def predict(rounds: Rounds) -> torch.Tensor:
        a = rounds.confidence.cumprod(1)
        cols = [y[torch.searchsorted(x, a[:, k].contiguous()).clamp(max=len(x) - 1)] for k, (x, y) in enumerate(tables)]
        return _monotone(torch.stack(cols, 1))

    return predict


FORMS = {"raw": lambda train: lambda rounds: rounds.confidence.cumprod(1), "sts": form_sts, "map": form_map,
         "map+quad": form_regression("quad"), "map+min": form_regression("min"), "hazard": form_hazard,
         "isotonic": form_isotonic}


def as_survival(rounds: Rounds, s: torch.Tensor) -> Rounds:
    """The rounds with confidences whose running products are s [N, γ] (for the metrics)."""
    prev = torch.cat([torch.ones_like(s[:, :1]), s[:, :-1]], 1)
    return rounds.with_confidence(torch.where(prev > 0, s / prev.clamp(min=1e-300), 0.0))


def compare(fit: Rounds, heldout: Rounds) -> dict:
    out = {}
    for name, form in FORMS.items():
        scored = as_survival(heldout, form(fit)(heldout))
        out[name] = {"ece": position_metrics(scored)["ece_mean"], "ece_in_sample": position_metrics(
            as_survival(fit, form(fit)(fit)))["ece_mean"]}
    out["floor"] = ece_floor(as_survival(heldout, form_map(fit)(heldout)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Calibration forms fitted on one trace file, scored on another.")
    p.add_argument("--fit", type=Path, required=True, action="append", help="traces to fit on (repeatable)")
    p.add_argument("--heldout", type=Path, required=True, action="append", help="traces to score on (same order)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if len(args.fit) != len(args.heldout):
        p.error("give one --heldout per --fit")
    report = []
    for fit_path, held_path in zip(args.fit, args.heldout, strict=True):
        (fit, meta), (held, held_meta) = load_traces(fit_path), load_traces(held_path)
        if (meta["drafter"], meta["verify"]) != (held_meta["drafter"], held_meta["verify"]):
            p.error(f"{fit_path} and {held_path} are of different drafters or rules")
        row = {"drafter": meta["drafter"], "verify": meta["verify"], "fit": str(fit_path), "heldout": str(held_path),
               "fit_rounds": len(fit), "heldout_rounds": len(held), **compare(fit, held)}
        report.append(row)
        forms = "  ".join(f"{n} {100 * row[n]['ece']:.2f}" for n in FORMS)
        print(f"{row['drafter']} · {row['verify']}: held-out ECE %  {forms}  (floor {100 * row['floor']:.2f})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
