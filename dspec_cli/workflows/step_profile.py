"""Whole speculative steps timed (``dspec profile-hardware --drafter``): drafting, verification and
host work together, the step time SGLang's DSpark planner prices.

The grid is SGLang's: R concurrent requests, each verifying v tokens (its anchor and v − 1
drafts, 1 <= v <= γ + 1), so a step verifies M = R·v tokens; the diagonal v = γ + 1 is what a
static (verify-all) step costs. Each cell runs dspec's engine on R random prompts of C tokens
with a scheduler that verifies exactly v − 1 drafts per row, and times whole rounds (the
engine's own round clock, drafter catch-up included) until ``warmup`` + ``repeats`` full rounds
are seen; the median of the last ``repeats`` is the cell's step time. Prompts never stop early
(no stop tokens) and are long enough that no request finishes inside the measured rounds.

:class:`StepProfile` turns the cells into a dspec cost table (its diagonal, per context,
``measures = "step"``) or either SGLang table (:mod:`dspec_cli.core.sglang_sps`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable, device_name
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.schedule import Scheduler


class _Enough(Exception):
    """Raised from inside the engine once a cell has its samples (ends the run early)."""


class _FixedWidth(Scheduler):
    """A scheduler verifying exactly ``width`` drafts per row that times the rounds it shaped."""

    name = "profile-fixed-width"

    def __init__(self, width: int, rows: int, needed: int):
        super().__init__()
        self.width, self.rows, self.needed = width, rows, needed
        self.seconds: list[float] = []
        self._full = False

    def __call__(self, proposal, lmax: torch.Tensor) -> torch.Tensor:  # lmax [R] -> ℓ [R]
        ell = lmax.clamp(max=self.width)
        self._full = bool((ell == self.width).all())
        return ell

    def observe_round(self, num_rows: int, seconds: float, drafted: bool, tokens=None, catch_up: float = 0.0) -> None:
        if drafted and num_rows == self.rows and self._full:
            self.seconds.append(seconds)
            if len(self.seconds) >= self.needed:
                raise _Enough


@dataclass
class StepProfile:
    """Median whole-step seconds per (context C, requests R, verified tokens M = R·v)."""

    block_size: int
    contexts: list[int]
    requests: list[int]
    verify_tokens: list[int]  # v per request, anchors included
    seconds: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (C, R, v) -> median seconds
    spread: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (C, R, v) -> IQR of steps/s
    meta: dict = field(default_factory=dict)  # device, device_name, dtype, model, torch, repeats, warmup

    def cost_table(self) -> CostTable:
        """The diagonal (v = γ + 1) as a dspec CostTable: B = R·(γ + 1), one row per context."""
        v = self.block_size + 1
        grid = [r * v for r in self.requests]
        sps = {str(c): [1.0 / self.seconds[c, r, v] for r in self.requests] for c in self.contexts}
        spread = {str(c): [self.spread[c, r, v] for r in self.requests] for c in self.contexts}
        return CostTable(**self.meta, grid=grid, contexts=list(self.contexts), measured=sps, spread=spread,
                         row_tokens=v, measures="step", block_size=self.block_size)

    def additive_cells(self) -> list[tuple[int, int, float]]:
        """(R, M, seconds) per cell, the step time averaged over contexts."""
        return [(r, r * v, statistics.fmean(self.seconds[c, r, v] for c in self.contexts))
                for r in self.requests for v in self.verify_tokens]


def tokens_after_context(block_size: int, repeats: int, warmup: int) -> int:
    """Tokens a cell's requests need after their context: the rounds it times at the widest v
    (γ + 1), two more, and one verify block."""
    return 2 + (warmup + repeats) * (block_size + 1) + block_size + 1


def profile_steps(
    target,
    drafter,
    *,
    requests: Sequence[int],
    verify_tokens: Sequence[int],
    contexts: Sequence[int],
    repeats: int = 10,
    warmup: int = 2,
    model_name: str = "",
    seed: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
) -> StepProfile:
    """Time whole steps of ``drafter`` on ``target`` over the grid (module docstring);
    ``progress(C, R, v)`` after each cell."""

    gamma = drafter.config.block_size
    requests, contexts = sorted(set(requests)), sorted(set(contexts))
    verify_tokens = sorted(set(verify_tokens) | {gamma + 1})  # the diagonal is always measured
    if not requests or requests[0] < 1 or not contexts or contexts[0] < 1:
        raise DspecError("--requests and --contexts values must be >= 1")
    if verify_tokens[0] < 1 or verify_tokens[-1] > gamma + 1:
        raise DspecError(f"--verify-tokens values must lie in [1, γ + 1 = {gamma + 1}], got {verify_tokens}")
    if repeats < 1 or warmup < 0:
        raise DspecError(f"need --repeats >= 1 and --warmup >= 0, got {repeats}, {warmup}")
    max_ctx = getattr(target.config, "max_position_embeddings", None)
    room = tokens_after_context(gamma, repeats, warmup)
    if max_ctx and contexts[-1] + room > max_ctx:
        raise DspecError(f"--contexts {contexts[-1]} plus {room} tokens generated per cell exceeds the target's "
                         f"context of {max_ctx} (give smaller --contexts, or fewer --repeats)")
    gen = torch.Generator().manual_seed(seed)
    out = StepProfile(gamma, contexts, requests, verify_tokens)
    for c in contexts:
        for r in requests:
            prompts = torch.randint(target.vocab_size, (r, c), generator=gen).tolist()
            for v in verify_tokens:
                timer = _FixedWidth(v - 1, r, warmup + repeats)
                config = GenerationConfig(max_new_tokens=2 + (warmup + repeats) * v, temperature=1.0,
                                          block_size=gamma, max_batch=r, seed=seed)
                try:
                    SpeculativeEngine(target, drafter, config, scheduler=timer, stop_ids=[]).generate(prompts)
                except _Enough:
                    pass
                timed = timer.seconds[warmup:]
                if len(timed) < repeats:
                    raise DspecError(f"only {len(timed)} full rounds at R = {r}, v = {v}: the drafter proposed fewer "
                                     f"than {v - 1} drafts")
                rates = [1.0 / t for t in timed]
                q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive") if repeats > 1 else rates * 3
                out.seconds[c, r, v], out.spread[c, r, v] = statistics.median(timed), q3 - q1
                if progress is not None:
                    progress(c, r, v)
    param = next(target.model.parameters())
    out.meta = {"device": param.device.type, "device_name": device_name(param.device),
                "dtype": str(param.dtype).replace("torch.", ""), "model": model_name, "torch": torch.__version__,
                "repeats": repeats, "warmup": warmup}
    return out
