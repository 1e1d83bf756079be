"""What the drafter has not seen yet, while the engine runs rounds without drafts (draft gate).

A round without a draft is a plain decoding step, so the drafter's state need not follow it at
once. :class:`DrafterLag` keeps, in engine row order,

* *pending admissions*: requests that joined the batch but were never handed to the drafter
  (prompt ids and the target's prompt taps); they are always the last rows of the batch;
* the *backlog*: committed tokens (and their taps) of rounds the drafter skipped.

:meth:`DrafterLag.flush` brings the drafter up to date right before it drafts: one
``add_requests`` for the pending rows, then one ``advance`` with every backlogged token of every
row, in order. A request that finishes while drafting is off never reaches the drafter at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspec_cli.drafter import Drafter, DraftState


@dataclass
class _Round:
    """Tokens one skipped round committed: committed [Σc], counts [R_t], taps [Σc, n·d] | None."""

    committed: torch.Tensor
    counts: torch.Tensor
    hidden: torch.Tensor | None

    def rows(self) -> torch.Tensor:
        """[Σc] the row of every entry."""
        return torch.repeat_interleave(torch.arange(self.counts.shape[0], device=self.counts.device), self.counts)


@dataclass
class DrafterLag:
    """Pending admissions (a suffix of the batch rows) and skipped rounds, for one engine run."""

    admitted: int = 0  # rows the drafter state holds (the first rows of the batch)
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (ids [L], taps [L, ·] | None)
    backlog: list[_Round] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.admitted + len(self.pending)

    def admit(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """New requests join at the end of the batch."""
        self.pending += list(zip(prompts, hidden if hidden is not None else [None] * len(prompts)))

    def skip(self, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A round without a draft committed ``counts`` [R] tokens per row."""
        self.backlog.append(_Round(committed, counts, hidden))

    def keep(self, drafter: Drafter, state: DraftState, keep: list[int]) -> None:
        """Only rows ``keep`` (ascending) stay: drop the others from the drafter state, the pending
        admissions and the backlog."""
        index = torch.tensor(keep, dtype=torch.long)
        for r, rnd in enumerate(self.backlog):
            mine = index[index < rnd.counts.shape[0]].to(rnd.counts.device)
            entry = torch.isin(rnd.rows(), mine)
            self.backlog[r] = _Round(
                rnd.committed[entry], rnd.counts[mine], None if rnd.hidden is None else rnd.hidden[entry]
            )
        kept_admitted = [r for r in keep if r < self.admitted]
        if len(kept_admitted) < self.admitted:
            drafter.remove_requests(state, kept_admitted)
        self.pending = [self.pending[r - self.admitted] for r in keep if r >= self.admitted]
        self.admitted = len(kept_admitted)

    def flush(self, drafter: Drafter, state: DraftState) -> None:
        """Bring the drafter up to date: admit the pending rows, then one ``advance`` with every
        backlogged token, each row's in order (rows newer than a round get count 0 for it)."""
        if self.pending:
            ids = [p for p, _ in self.pending]
            taps = None if self.pending[0][1] is None else [h for _, h in self.pending]
            drafter.add_requests(state, ids, taps)
            self.admitted, self.pending = self.rows, []
        if not self.backlog:
            return
        rows = torch.cat([rnd.rows() for rnd in self.backlog])
        order = torch.sort(rows, stable=True).indices
        committed = torch.cat([rnd.committed for rnd in self.backlog])[order]
        hidden = None if self.backlog[0].hidden is None else torch.cat([rnd.hidden for rnd in self.backlog])[order]
        counts = torch.bincount(rows, minlength=self.admitted)
        self.backlog.clear()
        drafter.advance(state, committed, counts, hidden)
