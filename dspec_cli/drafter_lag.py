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
class DrafterLag:
    """Pending admissions (a suffix of the batch rows) and skipped rounds' tokens, for one engine run.

    The backlog is kept flat, entry by entry in commit order: row [N], committed [N], taps [N, ·];
    a row's entries keep their order, so a stable sort by row gives each row's tokens in order.
    """

    admitted: int = 0  # rows the drafter state holds (the first rows of the batch)
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (ids [L], taps [L, ·] | None)
    backlog: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.admitted + len(self.pending)

    def admit(self, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """New requests join at the end of the batch."""
        self.pending += list(zip(prompts, hidden if hidden is not None else [None] * len(prompts)))

    def skip(self, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A round without a draft committed ``counts`` [R] tokens per row (committed [Σc], taps [Σc, ·])."""
        rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
        self.backlog.append((rows, committed, hidden))

    def keep(self, drafter: Drafter, state: DraftState, keep: list[int]) -> None:
        """Only rows ``keep`` (ascending) stay: drop the others from the drafter state, the pending
        admissions and the backlog (merged into one entry set, so repeated calls stay cheap)."""
        if self.backlog:
            rows, committed, hidden = self._merged()
            index = torch.tensor(keep, dtype=torch.long, device=rows.device)
            new_row = torch.full((self.rows,), -1, dtype=torch.long, device=rows.device)
            new_row[index] = torch.arange(len(keep), device=rows.device)
            rows = new_row[rows]
            entry = rows >= 0
            self.backlog = [(rows[entry], committed[entry], None if hidden is None else hidden[entry])]
        kept_admitted = [r for r in keep if r < self.admitted]
        if len(kept_admitted) < self.admitted:
            drafter.remove_requests(state, kept_admitted)
        self.pending = [self.pending[r - self.admitted] for r in keep if r >= self.admitted]
        self.admitted = len(kept_admitted)

    def flush(self, drafter: Drafter, state: DraftState) -> None:
        """Bring the drafter up to date: admit the pending rows, then one ``advance`` with every
        backlogged token, each row's in order (rows newer than a round have no entries in it)."""
        if self.pending:
            ids = [p for p, _ in self.pending]
            taps = None if self.pending[0][1] is None else [h for _, h in self.pending]
            drafter.add_requests(state, ids, taps)
            self.admitted, self.pending = self.rows, []
        if not self.backlog:
            return
        rows, committed, hidden = self._merged()
        self.backlog = []
        order = torch.sort(rows, stable=True).indices
        counts = torch.bincount(rows, minlength=self.admitted)
        drafter.advance(state, committed[order], counts, None if hidden is None else hidden[order])

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The backlog's entries concatenated: row [N], committed [N], taps [N, ·] | None."""
        rows = torch.cat([r for r, _, _ in self.backlog])
        committed = torch.cat([c for _, c, _ in self.backlog])
        hidden = None if self.backlog[0][2] is None else torch.cat([h for _, _, h in self.backlog])
        return rows, committed, hidden
