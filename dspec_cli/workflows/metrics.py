"""Acceptance metrics from engine results: τ, conditional acceptance, survival, throughput."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from dspec_cli.runtime.engine import RequestResult


def acceptance(results: Sequence[RequestResult], block_size: int) -> dict:
    """τ (committed tokens per round, bonus included) and per-position acceptance.

    cond_accept[k-1]: among rounds that verified position k and accepted 1..k-1, the share
    that accepted k (the DSpark paper's Fig. 2). survival[k-1]: among rounds that verified
    position k, the share whose accepted prefix reached k.
    """
    rounds = committed = verified = 0
    reach = [0] * block_size  # rounds with accepted >= k-1 and verified >= k
    acc = [0] * block_size  # ... that accepted k
    ver = [0] * block_size  # rounds that verified k
    for res in results:
        for ell, a in zip(res.verified, res.accepted, strict=True):
            rounds += 1
            committed += a + 1
            verified += ell
            for k in range(1, min(ell, block_size) + 1):
                ver[k - 1] += 1
                if a >= k - 1:
                    reach[k - 1] += 1
                if a >= k:
                    acc[k - 1] += 1
    return {
        "rounds": rounds,
        "tau": committed / rounds if rounds else 0.0,
        "mean_verified": verified / rounds if rounds else 0.0,
        "verified_per_committed": (verified + rounds) / committed if committed else 0.0,
        "cond_accept": [a / r if r else None for a, r in zip(acc, reach, strict=True)],
        "cond_accept_rounds": reach,  # rounds each cond_accept rests on
        "survival": [a / v if v else None for a, v in zip(acc, ver, strict=True)],
    }


def generated_tokens(results: Sequence[RequestResult]) -> int:
    return sum(len(r.output_ids) for r in results)


# Student's t, two-sided 95 %: t_0.975 by degrees of freedom 1..30 (beyond: Cornish-Fisher).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """Geometric mean of paired ratios and its 95 % t-interval (on log ratios), or None for
    fewer than two ratios: (mean, low, high)."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
