"""Goodness of fit: compare samples (single tokens or tuples of tokens) with exact
probabilities by Pearson's chi-square. scipy gives the chi-square tail when importable;
otherwise an exact regularized-gamma evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series below a+1, continued fraction above)."""
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # P(a, x) = e^{-x} x^a / Γ(a) · Σ_n x^n / (a(a+1)…(a+n))
        term = total = 1.0 / a
        denom = a
        for _ in range(100_000):
            denom += 1.0
            term *= x / denom
            total += term
            if term < total * 1e-17:
                break
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_front)))
    tiny = 1e-300  # modified Lentz evaluation of the continued fraction for Q
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_sf(statistic: float, dof: int, *, method: str = "auto") -> float:
    """P(χ²_dof ≥ statistic). method: "auto" (scipy if importable), "scipy" or "gamma"."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if method not in ("auto", "scipy", "gamma"):
        raise ValueError(f"method must be 'auto', 'scipy' or 'gamma', got {method!r}")
    if math.isinf(statistic):
        return 0.0
    if method != "gamma":
        try:
            from scipy.stats import chi2
        except ImportError:
            if method == "scipy":
                raise
        else:
            return float(chi2.sf(statistic, dof))
    return _gamma_q(dof / 2.0, statistic / 2.0)


def _as_float64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    return arr


def _pool_low_bins(obs: np.ndarray, exp: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge the smallest-expectation bins into one bin until every bin expects >= min_expected."""
    order = np.argsort(exp, kind="stable")
    csum = np.cumsum(exp[order])
    k = int((exp < min_expected).sum())
    if k == 0:
        return obs, exp
    k = min(len(exp), max(k, int(np.searchsorted(csum, min_expected)) + 1))
    rest = order[k:]
    return np.append(obs[rest], obs[order[:k]].sum()), np.append(exp[rest], csum[k - 1])


def chi_square_gof(observed_counts, expected_probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of counts [K] against probabilities [K].

    Bins expecting fewer than ``min_expected`` samples are pooled into one bin. Any count in a
    zero-probability bin is an immediate failure: (inf, dof, 0.0). Returns (statistic, dof,
    p_value); a single (pooled) bin gives (0.0, 0, 1.0).
    """
    obs = _as_float64(observed_counts, "observed_counts")
    probs = _as_float64(expected_probs, "expected_probs")
    if obs.shape != probs.shape:
        raise ValueError(f"observed_counts has {obs.size} bins but expected_probs has {probs.size}")
    total = probs.sum()
    if abs(total - 1.0) > 1e-4:
        raise ValueError(f"expected_probs must sum to 1, got {total:.6g}")
    n = obs.sum()
    if n <= 0:
        raise ValueError("observed_counts must hold at least one sample")
    support = probs > 0
    dof = max(int(support.sum()) - 1, 0)
    if np.any(obs[~support] > 0):
        return math.inf, dof, 0.0
    obs, exp = _pool_low_bins(obs[support], n * probs[support] / total, min_expected)
    dof = len(obs) - 1
    if dof == 0:
        return 0.0, 0, 1.0
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return statistic, dof, chi2_sf(statistic, dof)


@dataclass(frozen=True)
class GofResult:
    """Outcome of :func:`gof_test`; :meth:`describe` renders it with the most deviating bins."""

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    counts: np.ndarray  # [K] observed counts (flattened bins)
    probs: np.ndarray  # [K] expected probabilities
    shape: tuple[int, ...]  # shape of the expected table; bins of a joint print as tuples

    def worst_bins(self, k: int = 5) -> list[tuple[tuple[int, ...] | int, float, float, float]]:
        """The k bins with the largest |standardised residual|: (bin, observed freq, expected p, z)."""
        exp = self.num_samples * self.probs
        z = np.where(self.counts > 0, np.inf, 0.0)  # zero-probability bins
        pos = exp > 0
        z[pos] = (self.counts[pos] - exp[pos]) / np.sqrt(exp[pos])
        out = []
        for i in np.argsort(-np.abs(z), kind="stable")[:k]:
            label = tuple(int(j) for j in np.unravel_index(i, self.shape)) if len(self.shape) > 1 else int(i)
            out.append((label, self.counts[i] / self.num_samples, float(self.probs[i]), float(z[i])))
        return out

    def describe(self, name: str = "samples") -> str:
        lines = [
            f"{name}: chi-square = {self.statistic:.4g}, dof = {self.dof}, p = {self.p_value:.3g} "
            f"(n = {self.num_samples})",
            "  bin: observed freq vs expected prob (z)",
        ]
        lines += [f"  {b}: {o:.5f} vs {e:.5f} (z = {z:+.1f})" for b, o, e, z in self.worst_bins()]
        return "\n".join(lines)


def joint_index(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row-major flat index of token tuples: tokens [N, k] -> [N] in [0, V^k)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [N, k], got shape {tuple(tokens.shape)}")
    weights = vocab_size ** torch.arange(tokens.shape[1] - 1, -1, -1, device=tokens.device)
    return (tokens.long() * weights).sum(1)


def gof_test(samples: torch.Tensor, expected_probs, *, min_expected: float = 5.0) -> GofResult:
    """Chi-square test of samples against exact probabilities.

    expected_probs has shape [K] or, for joints of k tokens, [V]*k. samples is [N] (flat bin
    indices) or [N, k] token tuples when expected_probs has k dimensions. Samples outside the
    table (e.g. -1 padding) fail the test with p = 0.
    """
    expected = torch.as_tensor(expected_probs, dtype=torch.float64).cpu()
    samples = torch.as_tensor(samples).cpu().long()
    shape = tuple(expected.shape)
    if samples.dim() == 2:
        if samples.shape[1] != len(shape) or len(set(shape)) != 1:
            raise ValueError(f"samples of shape {tuple(samples.shape)} do not match expected_probs {shape}")
        bad = ((samples < 0) | (samples >= shape[0])).any(1)
        flat = joint_index(samples.clamp(0, shape[0] - 1), shape[0])
    elif samples.dim() == 1:
        bad = (samples < 0) | (samples >= expected.numel())
        flat = samples
    else:
        raise ValueError(f"samples must be [N] or [N, k], got shape {tuple(samples.shape)}")
    probs = expected.reshape(-1).numpy()
    counts = torch.bincount(flat[~bad], minlength=probs.size).double().numpy()
    n = int(samples.shape[0])
    if bad.any():
        statistic, dof, p = math.inf, int((probs > 0).sum()) - 1, 0.0
    else:
        statistic, dof, p = chi_square_gof(counts, probs, min_expected)
    return GofResult(statistic, dof, p, n, counts, probs / probs.sum(), shape)


def assert_same_distribution(
    samples: torch.Tensor,
    expected_probs,
    *,
    alpha: float = 1e-4,
    name: str = "samples",
    min_expected: float = 5.0,
) -> GofResult:
    """Raise AssertionError (statistic, dof, p, worst bins) unless the samples fit at level alpha."""
    result = gof_test(samples, expected_probs, min_expected=min_expected)
    if result.p_value < alpha:
        raise AssertionError(f"distribution mismatch (alpha = {alpha:g})\n" + result.describe(name))
    return result
