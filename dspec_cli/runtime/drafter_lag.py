"""What the drafter has not seen yet, while the engine runs rounds without drafts (draft gate).

A round without a draft is a plain decoding step, so the drafter's state need not follow it at
once. :class:`DrafterLag` keeps, in engine row order,

* *pending admissions*: requests that joined the batch but were never handed to the drafter
  (prompt ids and the target's prompt taps); they are always the last rows of the batch;
* the *backlog*: committed tokens (and their taps) of rounds the drafter skipped.

:meth:`DrafterLag.flush` brings the drafter up to date right before it drafts: one
``add_requests`` for the pending rows, then one ``advance`` with every backlogged token of every
row, in order. A request that finishes while drafting is off never reaches the drafter at all.

Backlog entries name their request by a *slot*, an id that stays fixed while rows shift, so a
request leaving costs no copy of the backlog: its entries are dropped at the next flush, or
when they outnumber the live ones (amortised; the backlog stays within twice its live size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspec_cli.runtime.drafter import Drafter, DraftState


@dataclass
class DrafterLag:
    """Pending admissions (a suffix of the batch rows) and skipped rounds' tokens, for one engine run.

    The backlog is kept flat, entry by entry in commit order: slot [N], committed [N], taps [N, ·];
    a request's entries keep their order, so a stable sort by row gives each row's tokens in order.
    """

    admitted: int = 0  # rows the drafter state holds (the first rows of the batch)
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (ids [L], taps [L, ·] | None)
    backlog: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = list(range(self.rows))  # slot of each batch row, in row order
        self._next = self.rows  # next unused slot
        self._slot_ids: torch.Tensor | None = None  # self.slots as a tensor on the backlog's device
        self._entries: torch.Tensor | None = None  # [rows] backlog entries per row
        self._dead = 0  # backlog entries of rows that left

    @property
    def rows(self) -> int:
        return self.admitted + len(self.pending)

    def admit(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """New requests join at the end of the batch: prompts [L_r] and hidden [L_r, n·d] (or None) per request."""
        self.pending += list(zip(prompts, hidden if hidden is not None else [None] * len(prompts), strict=True))
        self._set_slots(self.slots + list(range(self._next, self._next + len(prompts))))
        self._next += len(prompts)
        if self._entries is not None:
            self._entries = torch.cat([self._entries, self._entries.new_zeros(len(prompts))])

    def skip(self, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A round without a draft committed ``counts`` [R] tokens per row: committed [Σc];
        hidden [Σc, n·d] taps (or None)."""
        if self._slot_ids is None or self._slot_ids.device != counts.device:
            self._slot_ids = torch.tensor(self.slots, dtype=torch.long, device=counts.device)
        rows = torch.repeat_interleave(self._slot_ids, counts, output_size=committed.shape[0])
        self.backlog.append((rows, committed, hidden))
        self._entries = counts.clone() if self._entries is None else self._entries + counts

    def keep(self, drafter: Drafter, state: DraftState, keep: list[int]) -> None:
        """Only rows ``keep`` stay, in that order (rows the drafter has before pending ones): drop
        the others from the drafter state and the pending admissions; their backlog entries go at
        the next flush or compaction."""
        if self._entries is not None:
            index = torch.tensor(keep, dtype=torch.long, device=self._entries.device)
            live = self._entries[index]
            self._dead += int(self._entries.sum() - live.sum())
            self._entries = live
        kept_admitted = [r for r in keep if r < self.admitted]
        if keep[: len(kept_admitted)] != kept_admitted:
            raise ValueError("keep: rows the drafter has must come before pending admissions")
        if kept_admitted != list(range(self.admitted)):
            drafter.remove_requests(state, kept_admitted)
        self.pending = [self.pending[r - self.admitted] for r in keep if r >= self.admitted]
        self.admitted = len(kept_admitted)
        self._set_slots([self.slots[r] for r in keep])
        if self._dead and self._entries is not None and self._dead > int(self._entries.sum()):
            rows, committed, hidden = self._merged()  # compaction: one copy of the live entries
            slots = torch.tensor(self.slots, dtype=torch.long, device=rows.device)
            self.backlog, self._dead = [(slots[rows], committed, hidden)], 0

    def flush(self, drafter: Drafter, state: DraftState) -> None:
        """Bring the drafter up to date: admit the pending rows, then one ``advance`` with every
        backlogged token, each row's in order (rows newer than a round have no entries in it)."""
        if self.pending:
            ids = [p for p, _ in self.pending]
            taps = None if self.pending[0][1] is None else [h for _, h in self.pending if h is not None]  # all or none
            drafter.add_requests(state, ids, taps)
            self.admitted, self.pending = self.rows, []
        if not self.backlog:
            return
        rows, committed, hidden = self._merged()
        self.backlog, self._entries, self._dead = [], None, 0
        order = torch.sort(rows, stable=True).indices
        counts = torch.bincount(rows, minlength=self.admitted)
        drafter.advance(state, committed[order], counts, None if hidden is None else hidden[order])

    def _set_slots(self, slots: list[int]) -> None:
        self.slots, self._slot_ids = slots, None

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The live backlog entries concatenated: current row [N], committed [N], taps [N, ·] | None."""
        slots = torch.cat([s for s, _, _ in self.backlog])
        committed = torch.cat([c for _, c, _ in self.backlog])
        hidden = None if self.backlog[0][2] is None else torch.cat([h for _, _, h in self.backlog if h is not None])
        row_of = torch.full((self._next,), -1, dtype=torch.long, device=slots.device)
        row_of[torch.tensor(self.slots, dtype=torch.long, device=slots.device)] = torch.arange(
            len(self.slots), device=slots.device)
        rows = row_of[slots]
        if self._dead:
            live = rows >= 0
            rows, committed = rows[live], committed[live]
            hidden = None if hidden is None else hidden[live]
        return rows, committed, hidden
