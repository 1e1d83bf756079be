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
    steps: int = 200,
    generator: torch.Generator | None = None,
    layout: str = "packed",
) -> dict:
    """Run ``scheduler`` on R = ``concurrency`` rounds sampled from recorded traces (already
    calibrated: ``rounds.with_temperatures``), ``steps`` times.

    A round verified to ℓ commits min(accepted, ℓ) + 1 tokens (its recorded outcome cut at ℓ).
    Returns the mean draft length ℓ and verification budget ℓ + 1 per request, committed
    tokens per request per step (τ), the predicted τ from the survival products, and the
    throughput Σ tokens / Σ step time with step time 1/SPS(B): B = Σ(ℓ_r + 1) for an engine
    that packs ragged rows (``layout="packed"``, the paper's), B = R·(1 + max ℓ) for one that pads
    them to the longest (``"padded"``, dspec's engine on a transformers target); plus plain
    decoding's R·SPS(R) for reference.
    """
    if concurrency < 1:
        raise DspecError(f"--concurrency values must be >= 1, got {concurrency}")
    if steps < 1:
        raise DspecError(f"--steps must be >= 1, got {steps}")
    if len(rounds) == 0:
        raise DspecError("no recorded rounds to sample from")
    scheduler.reset()
    R, gamma = concurrency, rounds.block_size
    index = torch.randint(len(rounds), (steps, R), generator=generator)
    tokens = torch.zeros(R, gamma, dtype=torch.long)
    if layout not in ("packed", "padded"):
        raise DspecError(f"--layout must be packed or padded, got {layout!r}")
    padded = layout == "padded"
    draft = committed = predicted = seconds = 0.0
    for t in range(steps):
        batch = rounds.select(index[t])
        prop = Proposal(tokens=tokens, lengths=batch.verified, confidence=batch.confidence)
        ell = scheduler(prop, batch.verified).cpu()
        a = batch.confidence
        keep = torch.arange(gamma) < ell[:, None]
        draft += float(ell.sum())
        committed += float((torch.minimum(batch.accepted, ell) + 1).sum())
        predicted += float(R + (a.cumprod(1) * keep).sum())
        seconds += 1.0 / cost_table.sps(R * (1 + int(ell.max())) if padded else R + int(ell.sum()), scheduler.context)
    n = steps * R
    plain = R * cost_table.sps(R, scheduler.context)
    tps = committed / seconds
    return {
        "scheduler": scheduler.name,
        "concurrency": R,
        "layout": layout,
        "steps": steps,
        "mean_draft_len": draft / n,
        "budget": 1 + draft / n,
        "tau": committed / n,
        "predicted_tau": predicted / n,
        "tokens_per_s": tps,
        "plain_tokens_per_s": plain,
        "speedup": tps / plain,
    }
