"""Slot rows: the bookkeeping shared by dspec's slot caches, the target's KV cache
(``runtime.kv_cache.TargetBatch``) and a drafter's context cache
(:class:`~dspec_cli.nn.backbone.ContextCache`); gpt-fast's static cache with one length per row.

Buffers [row capacity, heads, slot capacity, head dim] are written in place and row r's entries
sit at slots 0..len_r−1, so the per-row lengths are the whole bookkeeping. The lengths live on
the device ([row capacity] long, updated in place, so a captured CUDA graph reads the current
values; rows past R are padding rows of length 0), with a host copy ``bounds``: exact when
``exact``, else an upper bound of each row after writes the host did not read (:meth:`bound`),
until the caller :meth:`settle` s them. Growing the buffers (:meth:`reserve`) copies them and
bumps ``generation``: graphs captured before would read stale memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_SLOTS = 64  # smallest slot capacity allocated
GROWTH = 1.5  # slot capacity grows at least by this factor when exceeded


def write_slots(
    bufs: Sequence[torch.Tensor],  # each [row capacity, H, slot capacity, D_i] (keys, values)
    row0: int,
    slots: torch.Tensor,  # [n, q] long: where each new entry of rows row0..row0+n-1 goes
    news: Sequence[torch.Tensor],  # each [n, H, q, D_i], into the buffer at its position
) -> None:
    """Write each of ``news`` into its buffer in place: entry (r, h, j) at buf[row0 + r, h,
    slots[r, j]]. One row copy per (row, head, entry) into the buffer seen as [rows·H·slots, D]
    (a scatter over a 4-d index costs several times more on a CPU); one index for all buffers."""
    n, heads, q, _ = news[0].shape
    row = torch.arange(row0, row0 + n, device=slots.device)[:, None, None]  # [n, 1, 1]
    head = torch.arange(heads, device=slots.device)[None, :, None]  # [1, H, 1]
    flat = ((row * heads + head) * bufs[0].shape[2] + slots[:, None, :]).reshape(n * heads * q)
    for buf, new in zip(bufs, news, strict=True):
        buf.view(-1, buf.shape[3]).index_copy_(0, flat, new.reshape(n * heads * q, buf.shape[3]).to(buf.dtype))


class SlotRows:
    """Rows of a slot cache (see the module docstring). Subclasses own the buffers:
    :meth:`buffers` lists them and :meth:`_resize` grows them."""

    def __init__(self, device: torch.device):
        self._lengths = torch.zeros(0, dtype=torch.long, device=device)  # [row capacity]
        self.num_rows = 0
        self.bounds: list[int] = []  # host copy of the lengths: exact, or an upper bound per row
        self.exact = True
        self.capacity = (0, 0)  # (rows, slots) the buffers hold
        self.generation = 0

    # -- the buffers (subclasses) -----------------------------------------------------------

    def buffers(self) -> list[torch.Tensor]:
        """Every allocated buffer [row capacity, heads, slot capacity, head dim]."""
        raise NotImplementedError

    def _resize(self, rows: int, slots: int) -> None:
        """Grow every buffer to ``rows`` rows and ``slots`` slots, keeping its contents."""
        raise NotImplementedError

    def _changed(self) -> None:
        """Called when rows joined, left or moved or the buffers grew; default: nothing."""

    # -- lengths ----------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """[R] long: entries per row = the next entry's slot (a view of the device buffer)."""
        return self._lengths[: self.num_rows]

    def lengths_rows(self, rows: int) -> torch.Tensor:
        """[rows] lengths of rows [0, rows): the R rows, then padding rows (length 0) up to the
        row capacity."""
        return self._lengths[:rows]

    def advance(self, counts: torch.Tensor) -> None:
        """Rows [0, n) hold ``counts`` [n] more entries (already written at their slots); no host
        read and no host bookkeeping (:meth:`bound`)."""
        self._lengths[: counts.shape[0]] += counts

    def bound(self, grown: int) -> None:
        """Every row may have grown by up to ``grown`` entries (writes the host did not read)."""
        self.bounds = [n + grown for n in self.bounds]
        self.exact = False

    def settle(self, lengths: Sequence[int]) -> None:
        """The host lengths, read by the caller after writes it did not count."""
        if len(lengths) != self.num_rows:
            raise ValueError(f"settle: expected {self.num_rows} lengths, got {len(lengths)}")
        self.bounds, self.exact = [int(n) for n in lengths], True

    # -- rows and capacity ------------------------------------------------------------------

    def reserve(self, rows: int, slots: int) -> bool:
        """Room for ``rows`` rows of ``slots`` slots: the buffers grow by copying (slots at least
        by ``GROWTH``, to ``MIN_SLOTS``), a new ``generation``; True when they grew (graphs
        captured over the old buffers are then stale)."""
        have_rows, have_slots = self.capacity
        if rows <= have_rows and slots <= have_slots:
            return False
        rows = max(rows, have_rows)
        slots = max(slots, int(have_slots * GROWTH), MIN_SLOTS) if slots > have_slots else have_slots
        self._resize(rows, slots)
        self.capacity = (rows, slots)
        lengths = self._lengths.new_zeros(rows)
        lengths[: self._lengths.shape[0]] = self._lengths
        self._lengths = lengths
        self.generation += 1
        self._changed()
        return True

    def add_rows(self, count: int, slots: int = 0) -> int:
        """``count`` empty rows join at the end (room for ``slots`` slots); returns the first."""
        first = self.num_rows
        self.reserve(first + count, slots)
        self._lengths[first : first + count] = 0
        self.num_rows += count
        self.bounds += [0] * count
        self._changed()
        return first

    def select_rows(self, index: Sequence[int] | torch.Tensor) -> None:
        """Rows become rows ``index`` [R'] of this cache, in that order; a repeated row is copied
        (every copy is an independent row from then on). Only rows that change place are copied."""
        index = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        if any(not 0 <= i < self.num_rows for i in index):
            raise ValueError(f"rows must be indices in [0, {self.num_rows}), got {index}")
        self.reserve(len(index), 0)
        moved = [r for r, i in enumerate(index) if r != i]
        if moved:
            dst = torch.tensor(moved, dtype=torch.long, device=self._lengths.device)
            src = torch.tensor([index[r] for r in moved], dtype=torch.long, device=self._lengths.device)
            for buf in self.buffers():
                buf.index_copy_(0, dst, buf.index_select(0, src))
            self._lengths.index_copy_(0, dst, self._lengths.index_select(0, src))
        self._lengths[len(index) : self.num_rows] = 0  # rows that left: zero length (padding rows)
        self.bounds = [self.bounds[i] for i in index]
        self.num_rows = len(index)
        self._changed()
