"""Whole speculative steps timed (``dspec profile-hardware --drafter``): drafting, verification and
host work together, the step time SGLang's DSpark planner prices.

The grid is SGLang's: R concurrent requests, each verifying v tokens (its anchor and v − 1
drafts, 1 <= v <= γ + 1), so a step verifies M = R·v tokens; the diagonal v = γ + 1 is what a
static (verify-all) step costs. Each cell runs dspec's engine on R random prompts of C tokens
and times whole rounds (the engine's own round clock, drafter catch-up included) until
``warmup`` + ``repeats`` rounds at width v are seen; the median of the last ``repeats`` is the
cell's step time. Prompts never stop early (no stop tokens) and are long enough that no request
finishes inside the measured rounds.

Cells are profiled by verified width, not by what the drafter happened to draft: a scheduler
verifies at most v − 1 drafts per row and every chain shorter than that is padded to v − 1
(repeats of its last token, one-hot q: verification stays exact, the filler is simply
rejected), so prompt lookup, which drafts nothing on random prompts, is timed at every width
too. A tree drafter (ddtree, eagle3 with ``tree``) verifies its whole tree each round: its one
width is 1 + the tree's nodes, whatever ``verify_tokens`` asks, and its table's diagonal is at
that width.

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
from dspec_cli.core.types import Proposal, Sampler
from dspec_cli.runtime.drafter import Drafter, DraftState, WrappedDrafter
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.schedule import Scheduler


class _Enough(Exception):
    """Raised from inside the engine once a cell has its samples (ends the run early)."""


class _Padded(WrappedDrafter):
    """``base`` with every chain padded to ``width`` drafts per row (module docstring); trees pass."""

    name = "profile-padded"

    def __init__(self, base: Drafter, width: int):
        super().__init__(base.config, base.target)
        self.base, self.width = base, width

    def confidence(self, state: DraftState, proposal: Proposal) -> torch.Tensor:
        return self.base.confidence(state, proposal)

    def propose(self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        p = self.base.propose(state, anchors, max_len, sampler)
        width = min(self.width, p.tokens.shape[1])
        if p.tree is not None or width == 0:
            return p
        last = p.tokens.gather(1, (p.lengths - 1).clamp(min=0)[:, None]).squeeze(1)  # [R]
        fill = torch.where(p.lengths > 0, last, anchors.to(p.tokens.device))  # [R]
        pos = torch.arange(p.tokens.shape[1], device=p.tokens.device)
        pad = (pos[None, :] >= p.lengths[:, None]) & (pos[None, :] < width)  # [R, γ]
        p.tokens = torch.where(pad, fill[:, None], p.tokens)
        if p.draft_probs is not None:  # [R, γ, V]: the filler is drawn from a one-hot q
            one_hot = torch.nn.functional.one_hot(fill, p.draft_probs.shape[-1]).to(p.draft_probs.dtype)
            p.draft_probs = torch.where(pad[..., None], one_hot[:, None, :], p.draft_probs)
        p.lengths = p.lengths.clamp(min=width)
        return p


class _FixedWidth(Scheduler):
    """Verifies at most ``width`` drafts per row (trees: the whole tree) and times the rounds in
    which every one of ``rows`` rows verified that many: ``widths`` holds each timed round's
    verified width (1 + drafts, or 1 + the widest tree's nodes), ``seconds`` its time."""

    name = "profile-fixed-width"

    def __init__(self, width: int, rows: int, needed: int):
        super().__init__()
        self.width, self.rows, self.needed = width, rows, needed
        self.seconds: list[float] = []
        self.widths: list[int] = []
        self.tree = False
        self._round: int | None = None  # this round's verified width, when every row verifies it

    def __call__(self, proposal, lmax: torch.Tensor) -> torch.Tensor:  # lmax [R] -> ℓ [R]
        if proposal.tree is not None:  # a tree is verified whole when ℓ > 0
            self.tree = True
            self._round = 1 + int(proposal.tree.num_nodes.max()) if bool((lmax > 0).all()) else None
            return lmax
        ell = lmax.clamp(max=self.width)
        self._round = self.width + 1 if bool((ell == self.width).all()) else None
        return ell

    def observe_round(self, num_rows: int, seconds: float, drafted: bool, tokens=None, catch_up: float = 0.0) -> None:
        if not (drafted and num_rows == self.rows and self._round is not None):
            return
        if self.widths and self._round != self.widths[0]:  # a tree of another size: keep the first one's
            return
        self.seconds.append(seconds)
        self.widths.append(self._round)
        if len(self.seconds) >= self.needed:
            raise _Enough


@dataclass
class StepProfile:
    """Median whole-step seconds per (context C, requests R, verified tokens M = R·v)."""

    block_size: int
    contexts: list[int]
    requests: list[int]
    verify_tokens: list[int]  # v per request, anchors included (a tree drafter: its one width)
    seconds: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (C, R, v) -> median seconds
    spread: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (C, R, v) -> IQR of steps/s
    meta: dict = field(default_factory=dict)  # device, device_name, dtype, model, torch, repeats, warmup
    tree: bool = False  # a tree drafter: verify_tokens is its one width

    def cost_table(self) -> CostTable:
        """The diagonal (v = γ + 1; a tree's width) as a dspec CostTable: B = R·v, one row per context."""
        v = max(self.verify_tokens)
        grid = [r * v for r in self.requests]
        sps = {str(c): [1.0 / self.seconds[c, r, v] for r in self.requests] for c in self.contexts}
        spread = {str(c): [self.spread[c, r, v] for r in self.requests] for c in self.contexts}
        return CostTable(**self.meta, grid=grid, contexts=list(self.contexts), measured=sps, spread=spread,
                         row_tokens=v, measures="step", block_size=self.block_size)

    def additive_cells(self) -> list[tuple[int, int, float]]:
        """(R, M, seconds) per cell, the step time averaged over contexts."""
        if self.tree:
            raise DspecError(f"a tree drafter verifies its whole tree ({self.verify_tokens[0]} tokens per request) "
                             "every step: SGLang's additive table needs several widths; use --format dspec or "
                             "sglang-diagonal")
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
    graphs: str = "auto",
    batch_invariant: bool | None = None,
) -> StepProfile:
    """Time whole steps of ``drafter`` on ``target`` over the grid (module docstring);
    ``progress(C, R, v)`` after each cell; ``graphs``, ``batch_invariant``: the engine's settings
    (GenerationConfig)."""

    gamma = drafter.config.block_size
    GenerationConfig(batch_invariant=batch_invariant).batch_invariance(target)  # asked for where it cannot apply: an error
    requests, contexts = sorted(set(requests)), sorted(set(contexts))
    verify_tokens = sorted(set(verify_tokens) | {gamma + 1})  # the diagonal is always measured
    if not requests or requests[0] < 1 or not contexts or contexts[0] < 1:
        raise DspecError("--requests and --contexts values must be >= 1")
    if verify_tokens[0] < 1 or verify_tokens[-1] > gamma + 1:
        raise DspecError(f"--verify-tokens values must lie in [1, γ + 1 = {gamma + 1}], got {verify_tokens}")
    if repeats < 1 or warmup < 0:
        raise DspecError(f"need --repeats >= 1 and --warmup >= 0, got {repeats}, {warmup}")
    max_ctx = target.max_context
    room = tokens_after_context(gamma, repeats, warmup)
    if max_ctx and contexts[-1] + room > max_ctx:
        raise DspecError(f"--contexts {contexts[-1]} plus {room} tokens generated per cell exceeds the target's "
                         f"context of {max_ctx} (give smaller --contexts, or fewer --repeats)")
    gen = torch.Generator().manual_seed(seed)
    out = StepProfile(gamma, contexts, requests, verify_tokens)
    tree_width: int | None = None  # a tree drafter's one verified width, once seen
    for c in contexts:
        for r in requests:
            prompts = torch.randint(target.vocab_size, (r, c), generator=gen).tolist()
            for v in verify_tokens:
                timer = _FixedWidth(v - 1, r, warmup + repeats)
                # room for every round to commit a whole block (γ + 1 tokens: a tree's path can be that long)
                config = GenerationConfig(max_new_tokens=2 + (warmup + repeats) * (gamma + 1), temperature=1.0,
                                          block_size=gamma, max_batch=r, seed=seed, graphs=graphs,
                                          batch_invariant=batch_invariant)
                try:
                    SpeculativeEngine(target, _Padded(drafter, v - 1), config, scheduler=timer,
                                      stop_ids=[]).generate(prompts)
                except _Enough:
                    pass
                timed = timer.seconds[warmup:]
                if len(timed) < repeats:
                    raise DspecError(f"only {len(timed)} rounds at R = {r}, v = {v} verified every row "
                                     f"({warmup + repeats} needed)")
                if timer.tree:
                    width = timer.widths[0]
                    if tree_width not in (None, width):
                        raise DspecError(f"the drafter's trees change size between cells ({tree_width - 1} and "
                                         f"{width - 1} nodes): a profile needs one verified width")
                    tree_width = v = width
                rates = [1.0 / t for t in timed]
                q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive") if repeats > 1 else rates * 3
                out.seconds[c, r, v], out.spread[c, r, v] = statistics.median(timed), q3 - q1
                if progress is not None:
                    progress(c, r, v)
                if timer.tree:  # the tree sets the width: the other widths would time the same steps
                    break
    if tree_width is not None:
        out.verify_tokens, out.tree = [tree_width], True
    param = next(target.model.parameters())
    out.meta = {"device": param.device.type, "device_name": device_name(param.device),
                "dtype": str(param.dtype).replace("torch.", ""), "model": model_name, "torch": torch.__version__,
                "repeats": repeats, "warmup": warmup}
    return out
