"""Acceptance metrics from engine results: τ, conditional acceptance, survival, predicted τ, throughput."""

from __future__ import annotations

import math
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


def predicted_tau(results: Sequence[RequestResult]) -> dict:
    """What the scheduler expected of chain rounds against what they committed: predicted_tau =
    mean over rounds of 1 + Σ_{k≤ℓ} Π_{j≤k} c_j from the calibrated confidences c the scheduler
    saw (a round without drafts: 1), beside the observed τ; and both over the rounds that
    verified at least one draft (``verifying_*``), where they can differ. None where the results
    do not hold one confidence list per round."""
    rounds = committed = predicted = 0
    v_rounds = v_committed = 0
    v_predicted = 0.0
    for res in results:
        if len(res.confidence) != len(res.verified):
            return {"predicted_tau": None, "verifying_rounds": None, "verifying_tau": None, "verifying_predicted_tau": None}
        for conf, acc in zip(res.confidence, res.accepted, strict=True):
            survival, expected = 1.0, 1.0
            for c in conf:
                survival *= c
                expected += survival
            rounds += 1
            committed += acc + 1
            predicted += expected
            if conf:
                v_rounds += 1
                v_committed += acc + 1
                v_predicted += expected
    return {
        "predicted_tau": predicted / rounds if rounds else None,
        "verifying_rounds": v_rounds,
        "verifying_tau": v_committed / v_rounds if v_rounds else None,
        "verifying_predicted_tau": v_predicted / v_rounds if v_rounds else None,
    }


def generated_tokens(results: Sequence[RequestResult]) -> int:
    return sum(len(r.output_ids) for r in results)


def median_ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """Distribution-free 95 % interval of the median of ``values`` (order statistics): [x_(k),
    x_(n+1-k)] with the largest k such that P(Binomial(n, 1/2) < k) <= 2.5 %, which holds the
    median with probability >= 95 % whatever the distribution. None for fewer than 6 values (no
    such k exists)."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0  # below = P(Binomial(n, 1/2) < k)
    while below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None
