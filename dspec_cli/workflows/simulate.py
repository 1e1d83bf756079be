"""Offline load simulation (the paper's Fig. 8, bottom row): a scheduler replayed on recorded
rounds against a cost table, without a model."""

from __future__ import annotations

import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.schedule import Scheduler
from dspec_cli.workflows.calibrate import Rounds


def simulate_load(
    scheduler: Scheduler,
    rounds: Rounds,
    cost_table: CostTable,
    *,
    concurrency: int,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    layout: str = "packed",
) -> dict:
    """Run ``scheduler`` on batches of R = ``concurrency`` recorded rounds (already calibrated:
    ``rounds.calibrated``), drawn without replacement in a random order (a fresh order each pass
    over the records): ``steps`` batches, or (None) one pass, ceil(N / R) batches of which the
    last holds the remaining rows, so every record counts once.

    A round verified to ℓ commits min(accepted, ℓ) + 1 tokens (its recorded outcome cut at ℓ;
    under either rule the chance that the accepted prefix reaches k <= ℓ does not depend on ℓ).
    Returns the mean draft length ℓ and verification budget ℓ + 1 per request, committed tokens
    per request per step (τ; the fixed scheduler's is the traces' own on one pass), the
    predicted τ from the survival products, and the throughput Σ tokens / Σ step time with step
    time 1/SPS(B): B = Σ(ℓ_r + 1) for an engine that packs ragged rows (``layout="packed"``, the
    paper's), B = R·(1 + max ℓ) for one that pads them to the longest (``"padded"``, dspec's
    engine on a transformers target); plus plain decoding's R·SPS(R) for reference.
    """
    if concurrency < 1:
        raise DspecError(f"--concurrency values must be >= 1, got {concurrency}")
    if steps is not None and steps < 1:
        raise DspecError(f"--steps must be >= 1, got {steps}")
    if len(rounds) == 0:
        raise DspecError("no recorded rounds to sample from")
    if layout not in ("packed", "padded"):
        raise DspecError(f"--layout must be packed or padded, got {layout!r}")
    scheduler.reset()
    R, gamma, n_rec = concurrency, rounds.block_size, len(rounds)
    total = n_rec if steps is None else steps * R
    order = torch.cat([torch.randperm(n_rec, generator=generator) for _ in range(-(-total // n_rec))])[:total]
    padded = layout == "padded"
    draft = committed = predicted = seconds = 0.0
    for start in range(0, total, R):
        batch = rounds.select(order[start : start + R])
        rows = len(batch)
        prop = Proposal(tokens=torch.zeros(rows, gamma, dtype=torch.long), lengths=batch.verified,
                        confidence=batch.confidence)
        ell = scheduler(prop, batch.verified).cpu()
        keep = torch.arange(gamma) < ell[:, None]
        draft += float(ell.sum())
        committed += float((torch.minimum(batch.accepted, ell) + 1).sum())
        predicted += float(rows + (batch.confidence.cumprod(1) * keep).sum())
        tokens = rows * (1 + int(ell.max())) if padded else rows + int(ell.sum())
        seconds += 1.0 / cost_table.sps(tokens, scheduler.context)
    plain = R * cost_table.sps(R, scheduler.context)
    tps = committed / seconds
    return {
        "scheduler": scheduler.name,
        "concurrency": R,
        "layout": layout,
        "steps": -(-total // R),
        "mean_draft_len": draft / total,
        "budget": 1 + draft / total,
        "tau": committed / total,
        "predicted_tau": predicted / total,
        "tokens_per_s": tps,
        "plain_tokens_per_s": plain,
        "speedup": tps / plain,
    }
