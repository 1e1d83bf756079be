"""Verification-length schedulers (DSpark §3.2.2, §5.2).

A scheduler is called once per engine round as ``scheduler(proposal, lmax) -> ℓ [R]`` with
0 <= ℓ_r <= lmax_r. To stay lossless it must be *non-anticipating*: whether x_{r,k} is
verified (ℓ_r >= k) may depend on c_{r,1..k} (c_k sees x_{k−1}, never x_k), on other rows
and on earlier rounds, but never on c_{r,k+1..} (those depend on x_k).

* ``fixed``: ℓ = lmax.
* ``threshold``: cut at the first position with c_k < t.
* ``hardware``: Algorithm 1. Survival products a_{r,j} = Π_{i≤j} c_{r,i} are sorted
  globally (descending, ties in row-major order) and admitted greedily while the expected
  throughput Θ = τ·SPS(B), τ = R + Σ admitted a, B = R + #admitted, keeps increasing; the
  first non-improving candidate stops the search. Row r's later candidates (j > k) never
  sort before (r, k), so admitting (r, k) only looks at values >= a_{r,k}: causal.
* ``async``: §5.2. The batch capacity K is chosen by an unconstrained global argmax of Θ
  over the sorted survival products of the round ``delay`` (= 2) calls earlier (with the
  current R); the current round admits its K largest survival products (a top-K, same
  ordering). Until ``delay`` rounds of history exist, K comes from Algorithm 1 on the
  current round. History lives in the scheduler object; :meth:`Scheduler.reset` clears it.

The two above are the paper's, for an engine that packs ragged rows (B = Σ(ℓ_r + 1)):
``layout="packed"``. dspec's engine verifies an [R, 1 + max ℓ] grid, so the default
``layout="padded"`` admits whole columns instead: every row verifies min(w, lmax_r), B =
R·(w + 1); ``hardware`` widens w while Θ rises (first non-improving column stops), ``async``
takes w by the global argmax over the per-row column means of the round ``delay`` calls earlier.
Column w's admission looks at columns <= w only, so it is non-anticipating too.

Candidates with a_{r,j} = 0 are never admitted. Confidences arrive calibrated: the engine
applies the drafter's ``calibration.json`` fit for the verification rule in use before the
scheduler sees them, so a_{r,j} estimates the chance that row r's accepted prefix reaches j
under that rule (docs/calibration.md).

Draft gate (``hardware`` and ``async``; ``gate=False`` turns it off): Algorithm 1 prices a
round by the target alone, as if drafting were free. Where it is not (a CPU; a drafter costly
next to the target) :class:`DraftGate` decides *before* drafting whether this round drafts at
all: from the mean survival curve of recent drafted rounds, the measured drafting time t and
the engine's measured per-round cost o beyond the profiled forward (plain rounds' wall time
minus 1/SPS(R)) it predicts the best Θ = τ / (1/SPS(B) + t + o) and drafts only if that beats
plain decoding's R / (1/SPS(R) + o). With the gate, Algorithm 1 and the async capacity search
also price a round as 1/SPS(B) + t + o (the paper's τ·SPS(B) when both are 0, as without the
gate). All of it looks at earlier rounds only, and a round without a draft is a plain decoding
step, so the gate cannot bias the output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import ClassVar

import torch

from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.types import Proposal

# --------------------------------------------------------------------------------------
# Building blocks (vectorised; no host syncs)
# --------------------------------------------------------------------------------------


def survival(confidence: torch.Tensor, lmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """confidence [R, γ], lmax [R] -> (a [R, γ] float64 = cumulative products, valid [R, γ]:
    j < lmax_r and a > 0)."""
    a = confidence.double().cumprod(1)
    j = torch.arange(confidence.shape[1], device=confidence.device)
    return a, (j < lmax[:, None]) & (a > 0)


def sorted_candidates(a: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid candidates first, by a [R, γ] descending (stable: row-major on ties); valid [R, γ] bool.

    Returns (values [Rγ] with invalid entries 0, row of each [Rγ], number of valid candidates []).
    """
    keyed = a.masked_fill(~valid, -1.0).flatten()
    values, order = keyed.sort(descending=True, stable=True)
    return values.clamp(min=0), torch.div(order, a.shape[1], rounding_mode="floor"), valid.sum()


def throughput(values: torch.Tensor, num_rows: int, sps: torch.Tensor) -> torch.Tensor:
    """Θ after admitting the first i sorted candidates values [Rγ], i = 0..Rγ: [Rγ + 1]
    (sps [B_max + 1] indexed by batch tokens B)."""
    tau = num_rows + torch.cat([values.new_zeros(1), values.cumsum(0)])
    batch = num_rows + torch.arange(values.shape[0] + 1, device=values.device)
    return tau * sps[batch]


def early_stop_count(values: torch.Tensor, num_valid: torch.Tensor, num_rows: int, sps: torch.Tensor) -> torch.Tensor:
    """Algorithm 1: admitted candidates before the first one that does not raise Θ (a [] count);
    values [Rγ], num_valid [] and sps [B_max + 1] as in :func:`sorted_candidates`, :func:`throughput`."""
    theta = throughput(values, num_rows, sps)
    idx = torch.arange(values.shape[0], device=values.device)
    improves = (theta[1:] > theta[:-1]) & (idx < num_valid)
    return improves.long().cumprod(0).sum()


def admit_candidates(
    a: torch.Tensor,  # [R, C] survival values
    valid: torch.Tensor,  # [R, C] bool
    sps: torch.Tensor,  # [B_max + 1] steps per second, indexed by batch tokens B
) -> torch.Tensor:
    """Algorithm 1 over any candidates: a [R, C] survival values, valid [R, C] -> the admitted
    mask [R, C]: candidates in descending order of a (row-major on ties) up to the first that does
    not raise Θ = (R + Σa)·SPS(R + count) (sps indexed by B). Prefix-closed whenever a never rises
    along a row's prefix order and that order is the row's index order (e.g. draft-tree nodes,
    parents and earlier siblings first)."""
    values, order = a.masked_fill(~valid, -1.0).flatten().sort(descending=True, stable=True)
    count = early_stop_count(values.clamp(min=0), valid.sum(), a.shape[0], sps)
    keep = torch.arange(values.shape[0], device=a.device) < count
    return torch.zeros_like(keep).scatter_(0, order, keep).view_as(valid)


def global_capacity(values: torch.Tensor, num_valid: torch.Tensor, num_rows: int, sps: torch.Tensor) -> torch.Tensor:
    """Unconstrained search: the K in [0, #valid] maximising Θ (first maximum, a [] count);
    values [Rγ], num_valid [] and sps [B_max + 1] as in :func:`early_stop_count`."""
    theta = throughput(values, num_rows, sps)
    allowed = torch.arange(theta.shape[0], device=theta.device) <= num_valid
    return theta.masked_fill(~allowed, -1.0).argmax()


def column_sums(a: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts per position over the rows: Σ_r a_{r,j} (valid only) [γ], from
    a [R, γ] and valid [R, γ]."""
    return (a * valid).sum(0)


def width_throughput(columns: torch.Tensor, num_rows: int, sps: torch.Tensor) -> torch.Tensor:
    """Θ(w) of a padded verify of width w = 0..γ drafts per row: [γ + 1], from columns [γ]
    (:func:`column_sums`) and sps [B_max + 1] indexed by B. Every row verifies
    its first min(w, lmax_r) drafts, so τ = R + Σ_{j ≤ w} columns_j and B = R·(w + 1)."""
    tau = num_rows + torch.cat([columns.new_zeros(1), columns.cumsum(0)])
    return tau * sps[num_rows * torch.arange(1, columns.shape[0] + 2, device=columns.device)]


def early_stop_width(theta: torch.Tensor) -> torch.Tensor:
    """Columns admitted before the first one that does not raise theta [γ + 1] (a [] count)."""
    return (theta[1:] > theta[:-1]).long().cumprod(0).sum()


def draft_throughput(survival_mean: torch.Tensor, num_rows: int, sps: torch.Tensor, draft_seconds: float,
                     padded: bool = False) -> float:
    """Best expected Θ over budgets K >= 1 when every row has the survival curve
    ā = survival_mean [γ] (non-increasing; sps [B_max + 1] indexed by B) and drafting costs ``draft_seconds`` per round: max_K τ_K / (1/SPS(R+K) + t);
    ``padded``: K a multiple of R, priced as B = R + K (whole columns)."""
    values = survival_mean.double().repeat_interleave(num_rows)  # already sorted: ā_1 ×R, ā_2 ×R, ...
    tau = num_rows + values.cumsum(0)
    batch = num_rows + torch.arange(1, values.shape[0] + 1)
    theta = tau / (1.0 / sps[batch] + draft_seconds)
    return float((theta[num_rows - 1 :: num_rows] if padded else theta).max())


class DraftGate:
    """Whether a round drafts at all (see the module docstring); state from past rounds only.

    ``draft_seconds`` fixes the drafting cost (deterministic runs, tests); None measures it
    (EMA per concurrency R, nearest measured R otherwise). While closed, the gate still drafts
    a *probe* round once the closed rounds' time times ``probe_share`` reaches what a probe
    costs, so probes take about ``probe_share`` of the time and the survival curve and drafting
    time stay current. Measured (``draft_seconds`` None): a closed round counts the measured
    time of plain rounds at its R, and a probe costs a drafted round's measured time minus a
    plain one's at the nearest R with both (drafting, the longer verify, the drafter catching
    up), at least its drafting time; until those are known, and with a fixed
    ``draft_seconds``, a closed round counts 1/SPS(R) and a probe its drafting time. Estimates
    persist across runs (:meth:`new_run`); :meth:`reset` forgets them.

    Measured rates (``measure=True``, the default; not with a fixed ``draft_seconds``): once
    ``min_rounds`` drafted rounds and a plain round at this R report their committed tokens,
    the gate compares drafted rounds' tokens with what plain decoding would have committed in
    their seconds at the plain rate of their own time (:meth:`measured`) instead of the
    prediction above, and while open it runs a plain *probe* round whenever the open
    rounds' time times ``probe_share`` reaches a plain round's time, so both rates stay
    current. Rates are averages (the first ``1/rate_smoothing`` rounds) then exponential
    moving averages of tokens and of seconds, drafted rounds without the drafter's catch-up
    on skipped rounds (a cost of probing, not of drafting). At an R without both rates,
    measured verdicts at other R decide where they apply (:meth:`inferred`: losing at a lower R
    means losing here, winning at a higher R means winning here). Where neither decides and
    the prediction keeps the gate closed at an R for ``4 · min_rounds`` rounds before the
    drafted rate is usable, the gate drafts ``min_rounds`` rounds in a row to measure it
    (probes alone would take hundreds of rounds to get there).
    """

    def __init__(self, *, draft_seconds: float | None = None, probe_share: float = 0.02, smoothing: float = 0.25,
                 padded: bool = False, measure: bool = True, min_rounds: int = 8, rate_smoothing: float = 0.03):
        if draft_seconds is not None and draft_seconds < 0:
            raise DspecError(f"draft_seconds must be >= 0, got {draft_seconds}")
        if not 0 < probe_share <= 1:
            raise DspecError(f"probe_share must be in (0, 1], got {probe_share}")
        if min_rounds < 1:
            raise DspecError(f"min_rounds must be >= 1, got {min_rounds}")
        if not 0 < rate_smoothing <= 1:
            raise DspecError(f"rate_smoothing must be in (0, 1], got {rate_smoothing}")
        self.draft_seconds, self.probe_share, self.smoothing = draft_seconds, probe_share, smoothing
        self.padded = padded  # rounds verify whole columns (see ``layout``)
        self.measure = measure and draft_seconds is None
        self.min_rounds, self.rate_smoothing = min_rounds, rate_smoothing
        self.reset()

    def reset(self) -> None:
        """Forget everything learned."""
        self.survival: torch.Tensor | None = None  # [γ] EMA of the mean survival curve (CPU float64)
        self.times: dict[int, float] = {}  # R -> EMA of drafting seconds per round
        self.rounds: dict[tuple[int, bool], float] = {}  # (R, drafted) -> EMA of whole-round seconds
        self.rates: dict[tuple[int, bool], Rate] = {}  # (R, drafted) -> committed tokens and seconds
        self.paired: dict[int, Rate] = {}  # R -> drafted rounds' tokens and plain-rate tokens in their time
        self.closed_at: dict[int, int] = {}  # R -> closed decisions (measured mode: when to explore)
        self.explored: dict[int, int] = {}  # R -> rounds drafted to measure the drafted rate
        self._verdict: tuple[int, bool] | None = None  # (R, prediction) until the next observation
        self.closed_seconds = 0.0  # time of closed rounds (measured or modelled) since the last drafted one
        self.open_seconds = 0.0  # time of open rounds since the last plain one (measured mode)
        self.new_run()

    def new_run(self) -> None:
        """A new engine run: keep the estimates (they describe drafter and hardware) and the time
        closed or open since the last probe (so many short runs still probe), zero the counts."""
        self.opened = self.closed = 0  # decisions taken

    def observe_survival(self, survival: torch.Tensor) -> None:
        """survival [R, γ]: the survival products of a drafted round (calibrated)."""
        mean = survival.double().mean(0).cpu()
        self.survival = mean if self.survival is None else self.survival + self.smoothing * (mean - self.survival)
        self._verdict = None

    def observe_time(self, num_rows: int, seconds: float) -> None:
        old = self.times.get(num_rows)
        self.times[num_rows] = seconds if old is None else old + self.smoothing * (seconds - old)
        self._verdict = None

    def observe_round(self, num_rows: int, seconds: float, drafted: bool, tokens: int | None = None,
                      catch_up: float = 0.0) -> None:
        """Wall time of a whole round (draft, verify, commit) with or without a draft; ``tokens``
        committed in it (all rows) and the ``catch_up`` seconds of the drafter's lag hand-over."""
        old = self.rounds.get((num_rows, drafted))
        self.rounds[num_rows, drafted] = seconds if old is None else old + self.smoothing * (seconds - old)
        if tokens is None or not self.measure:
            return
        busy = max(seconds - catch_up, 1e-9)
        plain = self.rates.get((num_rows, False))
        if drafted and plain is not None:  # against what plain decoding commits in that time now
            self.paired.setdefault(num_rows, Rate()).add(tokens, busy * plain.per_second, self.rate_smoothing)
        self.rates.setdefault((num_rows, drafted), Rate()).add(tokens, busy, self.rate_smoothing)
        first = self.rates.get((num_rows, True))
        if not drafted and num_rows not in self.paired and first is not None:
            # drafted rounds that ran before the first plain one: priced at this first plain rate
            self.paired[num_rows] = first.scaled(self.rates[num_rows, False].per_second)

    def measured(self, num_rows: int) -> bool | None:
        """Drafted rounds beat plain ones at R = ``num_rows`` (None: not yet measured): the drafted
        rounds' committed tokens against what plain decoding committed in the same seconds at its
        rate when each drafted round ran, so a slowdown of the whole machine moves both sides."""
        paired = self.paired.get(num_rows)
        if paired is None or paired.count < self.min_rounds:
            return None
        return paired.per_second > 1.0  # drafted tokens per plain-equivalent token

    def inferred(self, num_rows: int) -> bool | None:
        """The verdict at an R without its own measured rates, from those at other R: drafting that
        loses at a lower concurrency loses at a higher one, and drafting that wins at a higher
        concurrency wins at a lower one (larger batches make verification dearer). None when no
        measured R says so, or when measured R's contradict each other around ``num_rows``."""
        verdicts = {r: self.measured(r) for r in self.paired}
        loses = any(v is False and r <= num_rows for r, v in verdicts.items())
        wins = any(v is True and r >= num_rows for r, v in verdicts.items())
        return None if loses == wins else wins

    def _probe_cost(self, num_rows: int) -> float:
        """Expected extra seconds of a probe round over a plain one: measured at the nearest R
        with both kinds of rounds, never below the drafting time."""
        seconds = self._draft_seconds(num_rows) or 0.0
        both = [r for r, d in self.rounds if d and (r, False) in self.rounds]
        if self.draft_seconds is not None or not both:
            return seconds
        r = min(both, key=lambda r: (abs(r - num_rows), -r))
        return max(self.rounds[r, True] - self.rounds[r, False], seconds)

    def _draft_seconds(self, num_rows: int) -> float | None:
        if self.draft_seconds is not None or not self.times:
            return self.draft_seconds
        return self.times[min(self.times, key=lambda r: (abs(r - num_rows), -r))]

    def overhead(self, num_rows: int, sps: torch.Tensor) -> float:
        """Measured seconds of a plain round at R = ``num_rows`` beyond the cost table's forward
        (the engine's own per-round work; sps [B_max + 1] indexed by B); 0 until one is measured or with fixed ``draft_seconds``."""
        plain = self.rounds.get((num_rows, False)) if self.draft_seconds is None else None
        return 0.0 if plain is None else max(plain - 1.0 / float(sps[num_rows]), 0.0)

    def round_seconds(self, num_rows: int, sps: torch.Tensor) -> float:
        """What a drafted round costs beyond the target's forward: drafting plus :meth:`overhead`
        (sps [B_max + 1] indexed by B)."""
        return (self._draft_seconds(num_rows) or 0.0) + self.overhead(num_rows, sps)

    def _predict(self, num_rows: int, sps: torch.Tensor) -> bool:
        """Does drafting beat plain decoding at R = ``num_rows``, going by the past? ``sps``
        indexed by B (:meth:`CostTable.sps_curve`, >= R·(γ+1) entries)."""
        seconds = self._draft_seconds(num_rows)
        if self.survival is None or seconds is None:
            return True  # nothing to predict from yet: draft and measure
        sps = sps.cpu()
        extra = self.overhead(num_rows, sps)
        plain = num_rows / (1.0 / float(sps[num_rows]) + extra)
        return draft_throughput(self.survival, num_rows, sps, seconds + extra, self.padded) > plain

    def decide(self, num_rows: int, sps: Callable[[], torch.Tensor]) -> bool:
        """Draft this round? Measured rates at this R when there are (:meth:`measured`), else
        what measured rates at other R imply (:meth:`inferred`), else :meth:`_predict` on
        ``sps()``, the SPS curve [B_max + 1] (its verdict reused until R changes or a drafted round brings
        new observations) or a measuring run of drafted rounds."""
        is_open = self.measured(num_rows)
        if is_open is None:
            is_open = self.inferred(num_rows)
        if is_open is None:
            if self._verdict is None or self._verdict[0] != num_rows:
                self._verdict = (num_rows, self._predict(num_rows, sps()))
            is_open = self._verdict[1] or self._explore(num_rows)
        if not is_open:  # a probe once the closed rounds have "paid" for one
            plain = self.rounds.get((num_rows, False)) if self.draft_seconds is None else None
            self.closed_seconds += plain if plain is not None else 1.0 / float(sps()[num_rows])
            is_open = self.closed_seconds * self.probe_share >= self._probe_cost(num_rows)
        elif self.measure and (num_rows, True) in self.rounds:  # a plain probe once open rounds have paid for one
            self.open_seconds += self.rounds[num_rows, True]
            plain = self.rounds.get((num_rows, False))
            drafted = self.rates.get((num_rows, True))
            due = plain is None and drafted is not None and drafted.count >= self.min_rounds
            if due or (plain is not None and self.open_seconds * self.probe_share >= plain):
                is_open, self.open_seconds = False, 0.0
        if is_open:
            self.closed_seconds = 0.0
        else:
            self.closed_at[num_rows] = self.closed_at.get(num_rows, 0) + 1
        self.opened += is_open
        self.closed += not is_open
        return is_open

    def _explore(self, num_rows: int) -> bool:
        """Measured mode, no usable drafted rate at R but a plain one: draft ``min_rounds``
        rounds in a row (once) after ``4 · min_rounds`` closed rounds at R."""
        done = self.explored.get(num_rows, 0)
        if not self.measure or (num_rows, False) not in self.rates or done >= self.min_rounds:
            return False
        if self.closed_at.get(num_rows, 0) < 4 * self.min_rounds:
            return False
        self.explored[num_rows] = done + 1
        return True


class Rate:
    """Committed tokens per second of one kind of round: an average over the first 1/α rounds,
    then exponential moving averages (factor α) of tokens and of seconds."""

    def __init__(self):
        self.count, self.tokens, self.seconds = 0, 0.0, 0.0

    def add(self, tokens: float, seconds: float, alpha: float) -> None:
        self.count += 1
        weight = max(1.0 / self.count, alpha)
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds

    def scaled(self, factor: float) -> Rate:
        """The same rounds with their seconds multiplied by ``factor``."""
        rate = Rate()
        rate.count, rate.tokens, rate.seconds = self.count, self.tokens, self.seconds * factor
        return rate


def admit(rows: torch.Tensor, count: torch.Tensor, num_rows: int) -> torch.Tensor:
    """ℓ [R]: how many of the first ``count`` [] sorted candidates belong to each row (rows [Rγ]:
    the row of each candidate)."""
    take = (torch.arange(rows.shape[0], device=rows.device) < count).long()
    return torch.zeros(num_rows, dtype=torch.long, device=rows.device).index_add_(0, rows, take)


# --------------------------------------------------------------------------------------
# Schedulers
# --------------------------------------------------------------------------------------


class Scheduler:
    """Base class: ``scheduler(proposal, lmax [R]) -> ℓ [R]``. Subclasses implement :meth:`lengths`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs_cost_table: ClassVar[bool] = False

    def __init__(self, cost_table: CostTable | None = None, *, context: float | None = None,
                 gate: DraftGate | None = None):
        if self.needs_cost_table and cost_table is None:
            raise DspecError(f"scheduler {self.name!r} needs a cost table (dspec profile-hardware; --cost-table)")
        if gate is not None and cost_table is None:
            raise DspecError(f"scheduler {self.name!r}: the draft gate needs a cost table")
        self.cost_table = cost_table
        # context length for SPS lookups: fixed here, or (None) each round's mean context as the
        # engine reports it (observe_context; until then the mean over the profiled contexts)
        self.context = context
        self._fixed_context = context is not None
        self.gate = gate

    def __call__(self, proposal: Proposal, lmax: torch.Tensor) -> torch.Tensor:
        """ℓ [R] for the proposal's rows, each at most lmax [R]."""
        if proposal.confidence is None:
            raise ValueError(f"scheduler {self.name!r} needs proposal.confidence")
        conf = proposal.confidence  # [R, γ], calibrated by the engine
        if self.gate is not None:
            self.gate.observe_survival(conf.double().cumprod(1))
        return self.lengths(conf, lmax.to(conf.device))

    def wants_draft(self, num_rows: int, gamma: int) -> bool:
        """Called by the engine before drafting a round of ``num_rows`` rows (draft gate)."""
        if self.gate is None:
            return True
        return self.gate.decide(num_rows, lambda: self._sps(num_rows * (gamma + 1), torch.device("cpu")))

    def observe_context(self, mean_context: float) -> None:
        """Called by the engine before each round with its rows' mean context length (prompt and
        generated tokens): the SPS lookups' context unless the constructor fixed one."""
        if not self._fixed_context:
            self.context = mean_context

    def observe_draft_time(self, num_rows: int, seconds: float) -> None:
        """Called by the engine after each drafted round with its drafting time."""
        if self.gate is not None:
            self.gate.observe_time(num_rows, seconds)

    def observe_round(self, num_rows: int, seconds: float, drafted: bool, tokens: int | None = None,
                      catch_up: float = 0.0) -> None:
        """Called by the engine after every round: its wall time, whether it drafted, the tokens
        it committed (all rows) and the seconds the drafter spent catching up on skipped rounds."""
        if self.gate is not None:
            self.gate.observe_round(num_rows, seconds, drafted, tokens, catch_up)

    def lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:  # [R, γ], [R] -> [R]
        raise NotImplementedError

    def reset(self) -> None:
        """A new run: forget state kept across rounds (the draft gate keeps its estimates of the
        drafter's cost and survival curve; ``gate.reset()`` forgets those too)."""
        if self.gate is not None:
            self.gate.new_run()

    def _sps(self, max_tokens: int, device: torch.device) -> torch.Tensor:
        assert self.cost_table is not None  # only the draft gate and cost-aware schedulers look up SPS
        return self.cost_table.sps_curve(max_tokens, self.context, device)


class FixedScheduler(Scheduler):
    name = "fixed"
    description = "verify every proposed draft (ℓ = lmax)"

    def __call__(self, proposal: Proposal, lmax: torch.Tensor) -> torch.Tensor:  # lmax [R] -> ℓ [R]
        return lmax  # needs no confidence

    def lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:  # [R, γ], [R] -> [R]
        return lmax


class ThresholdScheduler(Scheduler):
    name = "threshold"
    description = "static threshold: cut at the first position with c_k < t"

    def __init__(self, cost_table: CostTable | None = None, *, threshold: float = 0.5, **kwargs):
        super().__init__(cost_table, **kwargs)
        if not 0.0 <= threshold <= 1.0:
            raise DspecError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:  # [R, γ], [R] -> [R]
        kept = (confidence >= self.threshold).long().cumprod(1).sum(1)
        return torch.minimum(kept, lmax)


class _GatedScheduler(Scheduler):
    """Hardware-aware schedulers: a cost table, a verify ``layout`` and, unless ``gate=False``,
    a :class:`DraftGate`."""

    needs_cost_table = True
    LAYOUTS = ("packed", "padded")

    def __init__(self, cost_table: CostTable | None = None, *, gate: bool = True, draft_seconds: float | None = None,
                 probe_share: float = 0.02, layout: str = "padded", measure: bool = True, **kwargs):
        if layout not in self.LAYOUTS:
            raise DspecError(f"layout must be one of {', '.join(self.LAYOUTS)}, got {layout!r}")
        self.layout = layout
        padded = layout == "padded"
        gate = gate and cost_table is not None and cost_table.measures != "step"  # a step table already prices drafting
        draft_gate = DraftGate(draft_seconds=draft_seconds, probe_share=probe_share, padded=padded,
                               measure=measure) if gate else None
        super().__init__(cost_table, gate=draft_gate, **kwargs)

    def _round_sps(self, num_rows: int, max_tokens: int, device: torch.device) -> torch.Tensor:
        """Rounds per second by B for R = ``num_rows``: 1 / (1/SPS(B) + t + o) with the gate's
        measured drafting time t and per-round cost o (SPS(B) itself without a gate)."""
        sps = self._sps(max_tokens, device)
        if self.gate is None:
            return sps
        extra = self.gate.round_seconds(num_rows, self._sps(num_rows, torch.device("cpu")))  # host floats
        return sps if extra == 0.0 else 1.0 / (1.0 / sps + extra)


class HardwareScheduler(_GatedScheduler):
    name = "hardware"
    description = "DSpark Algorithm 1: global greedy admission by survival, early stop on expected throughput; draft gate"

    def lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:  # [R, γ], [R] -> [R]
        R, gamma = confidence.shape
        sps = self._round_sps(R, R * (gamma + 1), confidence.device)
        if self.layout == "padded":
            return torch.minimum(lmax, early_stop_width(width_throughput(column_sums(*survival(confidence, lmax)), R, sps)))
        values, rows, num_valid = sorted_candidates(*survival(confidence, lmax))
        return admit(rows, early_stop_count(values, num_valid, R, sps), R)


class AsyncScheduler(_GatedScheduler):
    name = "async"
    description = "DSpark §5.2: capacity K from confidences two rounds old (global search), top-K now; draft gate"

    def __init__(self, cost_table: CostTable | None = None, *, delay: int = 2, **kwargs):
        super().__init__(cost_table, **kwargs)
        if delay < 1:
            raise DspecError(f"delay must be >= 1, got {delay}")
        self.delay = delay
        self._history: deque = deque(maxlen=delay)  # (sorted values, #valid) of past rounds

    def reset(self) -> None:
        super().reset()
        self._history.clear()

    def lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:  # [R, γ], [R] -> [R]
        if self.layout == "padded":
            return self._padded_lengths(confidence, lmax)
        R, gamma = confidence.shape
        values, rows, num_valid = sorted_candidates(*survival(confidence, lmax))
        if len(self._history) == self.delay:
            old_values, old_valid = self._history[0]
            sps = self._round_sps(R, R + old_values.shape[0], confidence.device)
            capacity = global_capacity(old_values, old_valid, R, sps)
        else:  # warm-up: the causal Algorithm 1 on the current round
            capacity = early_stop_count(values, num_valid, R, self._round_sps(R, R * (gamma + 1), confidence.device))
        self._history.append((values, num_valid))
        return admit(rows, torch.minimum(capacity, num_valid), R)

    def _padded_lengths(self, confidence: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:
        """Width w by a global argmax of Θ(w) over the per-row column means of the round
        ``delay`` calls earlier (scaled to the current R), else by the early stop on this round;
        every row verifies min(w, lmax_r)."""
        R, gamma = confidence.shape
        columns = column_sums(*survival(confidence, lmax))  # [γ]
        sps = self._round_sps(R, R * (gamma + 1), confidence.device)
        if len(self._history) == self.delay:
            width = width_throughput(self._history[0] * R, R, sps).argmax()
        else:
            width = early_stop_width(width_throughput(columns, R, sps))
        self._history.append(columns / R)
        return torch.minimum(lmax, width)


BUILTIN_SCHEDULERS = (FixedScheduler, ThresholdScheduler, HardwareScheduler, AsyncScheduler)


def build_scheduler(name: str, cost_table: CostTable | None = None, **options) -> Scheduler:
    """A registered scheduler by name (plugins included); options go to its constructor."""

    cls = plugins.get_scheduler_class(name)
    try:
        return cls(cost_table, **options)
    except TypeError as exc:  # an option this scheduler does not take
        raise DspecError(f"scheduler {name!r}: {exc}") from None




