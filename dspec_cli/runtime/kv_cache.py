"""Slot bookkeeping of a batch KV cache: validity, logical positions, holes, compaction.

The cache is one ``DynamicCache`` whose layers (:class:`SlackLayer`: new slots are written into
spare capacity, not concatenated) hold keys/values ``[R, H, S, D]`` over S *slots*.
Each verify step writes the new tokens of every row at the same slot range (right-padded per
row); the slots of rejected drafts and of padding stay in place as *holes*, hidden from
attention by a per-row validity mask. Each slot also remembers the logical (RoPE) position
of its token, so sliding-window masks are exact even with holes. Compaction gathers each
row's valid slots to the left, shrinking S to the longest row; it runs automatically once the
slots it would reclaim exceed a fraction of S, or S exceeds a bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PendingStep", "SlackLayer", "TargetBatch", "ancestor_visibility", "attention_layout", "causal_visibility"]


@dataclass
class PendingStep:
    """The tokens of the last verify, waiting for commit()/commit_path()."""

    start: int  # first slot of the verified tokens
    n: list[int]  # tokens per row (host copy)
    parents: torch.Tensor | None  # [R, q] row-local parents (-1: root or padding); None for chains


class TargetBatch:
    """One KV cache for a batch of requests plus per-row slot validity and positions.

    Attributes: ``cache`` (DynamicCache), ``valid`` [R, S] bool, ``pos`` [R, S] long (logical
    position of each slot), ``committed`` [R] long (committed length = next RoPE position =
    number of valid slots), ``lengths`` (host copy of ``committed``), ``layer_ids`` (tapped
    decoder layers). Built by ``Target.new_batch``; all mutation goes through ``Target``.
    """

    def __init__(
        self,
        layer_ids: Sequence[int],
        device: torch.device,
        compact_fraction: float = 0.25,
        max_slots: int | None = None,
        kv_layer: type | None = None,
    ):
        if not 0.0 <= compact_fraction <= 1.0:
            raise ValueError(f"compact_fraction must be in [0, 1], got {compact_fraction}")
        if max_slots is not None and max_slots < 1:
            raise ValueError(f"max_slots must be positive, got {max_slots}")
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.device = torch.device(device)
        self.compact_fraction = compact_fraction
        self.max_slots = max_slots
        self.kv_layer = kv_layer or SlackLayer  # cache layer class (DynamicLayer: transformers' own)
        self.pending: PendingStep | None = None
        self.num_compactions = 0
        self._reset(0)

    def _reset(self, rows: int) -> None:
        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = self.kv_layer  # layers are made on first use
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)  # [R, S]
        self.pos = torch.zeros(rows, 0, dtype=torch.long, device=self.device)  # [R, S]
        self.committed = torch.zeros(rows, dtype=torch.long, device=self.device)  # [R]
        self.lengths: list[int] = [0] * rows

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def holes(self) -> int:
        """Invalid slots (rejected drafts, padding, ragged tails)."""
        return self.num_rows * self.num_slots - sum(self.lengths)

    def empty_like(self, rows: int) -> TargetBatch:
        """A batch with this one's settings, ``rows`` rows and no slots (for prefill)."""
        fresh = TargetBatch(self.layer_ids, self.device, self.compact_fraction, self.max_slots, self.kv_layer)
        fresh._reset(rows)
        return fresh

    def _kv_layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def require_idle(self, what: str) -> None:
        if self.pending is not None:
            raise ValueError(f"{what}: the last verify has not been committed yet")

    # -- masks -------------------------------------------------------------------------------

    def attention_masks(
        self,
        pos_q: torch.Tensor,  # [R, q] logical positions of the new tokens
        vis: torch.Tensor,  # [R, q, q] bool: new token i sees new token j
        window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Boolean masks [R, 1, q, S+q] (True = attend) for full and sliding-window layers."""
        rows, q = pos_q.shape
        full = torch.cat([self.valid[:, None, :].expand(rows, q, self.num_slots), vis], dim=2)
        sliding = None
        if window is not None:
            pos_k = torch.cat([self.pos, pos_q], dim=1)  # [R, S+q]
            sliding = full & ((pos_q[:, :, None] - pos_k[:, None, :]) < window)
            sliding = sliding[:, None]
        return full[:, None], sliding

    # -- step bookkeeping ----------------------------------------------------------------------

    def open_step(self, valid_new: torch.Tensor, pos_new: torch.Tensor, pending: PendingStep) -> None:
        """Record the q slots a verify forward just appended to every cache layer ([R, q] each)."""
        self.valid = torch.cat([self.valid, valid_new], dim=1)
        self.pos = torch.cat([self.pos, pos_new], dim=1)
        self.pending = pending

    def append_step(self, valid_new: torch.Tensor, pos_new: torch.Tensor, added: list[int]) -> None:
        """Record q slots [R, q] appended and committed at once (``added[r]`` valid ones per row)."""
        self.valid = torch.cat([self.valid, valid_new], dim=1)
        self.pos = torch.cat([self.pos, pos_new], dim=1)
        self._add_committed(added)

    def record_prefill(self, valid: torch.Tensor, pos: torch.Tensor, lengths: list[int]) -> None:
        """Record the slots [R, P] a prefill forward wrote into this (empty) batch's cache."""
        self.valid, self.pos, self.lengths = valid, pos, list(lengths)
        self.committed = torch.tensor(lengths, dtype=torch.long, device=self.device)

    def close_step(self, keep_new: torch.Tensor, added: list[int]) -> None:
        """Finish a verify: ``keep_new`` [R, q] marks the committed slots, ``added`` counts them per row."""
        assert self.pending is not None, "close_step without an open step"
        self.valid[:, self.pending.start :] = keep_new
        self.pending = None
        self._add_committed(added)

    def _add_committed(self, added: list[int]) -> None:
        """Rows grew by ``added`` committed tokens; trim or compact the holes that leaves."""
        self.committed = self.committed + torch.tensor(added, dtype=torch.long, device=self.device)
        self.lengths = [a + b for a, b in zip(self.lengths, added, strict=True)]
        self.maybe_compact()

    def extend(self, other: TargetBatch) -> None:
        """Append the rows of ``other`` (a freshly prefilled batch) after this batch's rows."""
        if self.num_rows == 0:
            self.cache, self.valid, self.pos = other.cache, other.valid, other.pos
            self.committed, self.lengths = other.committed, list(other.lengths)
            return
        width = max(self.num_slots, other.num_slots)
        mine, theirs = self._kv_layers(), other._kv_layers()
        if len(mine) != len(theirs):
            raise ValueError("extend: the two caches have different numbers of layers")
        for a, b in zip(mine, theirs, strict=True):
            a.keys = torch.cat([_pad_slots(a.keys, width, 2), _pad_slots(b.keys, width, 2)], dim=0)
            a.values = torch.cat([_pad_slots(a.values, width, 2), _pad_slots(b.values, width, 2)], dim=0)
        self.valid = torch.cat([_pad_slots(self.valid, width, 1), _pad_slots(other.valid, width, 1)])
        self.pos = torch.cat([_pad_slots(self.pos, width, 1), _pad_slots(other.pos, width, 1)])
        self.committed = torch.cat([self.committed, other.committed])
        self.lengths = self.lengths + other.lengths

    def rollback(self, drop: torch.Tensor) -> None:
        """Un-commit the last ``drop[r]`` committed tokens of each row [R] (their slots become holes)."""
        self.require_idle("rollback")
        drop_list = drop.tolist()
        if len(drop_list) != self.num_rows or any(not 0 <= d <= m for d, m in zip(drop_list, self.lengths, strict=True)):
            raise ValueError(f"drop must be [R] with 0 <= drop[r] <= committed={self.lengths}, got {drop_list}")
        self.committed = self.committed - drop.to(self.device, torch.long)
        self.valid &= self.pos < self.committed[:, None]  # valid slots hold positions 0..committed-1
        self.lengths = [m - d for m, d in zip(self.lengths, drop_list, strict=True)]
        self.maybe_compact()

    def remove(self, rows: Sequence[int]) -> None:
        """Drop the given rows; the remaining rows keep their order."""
        self.require_idle("remove")
        drop = {int(r) for r in rows}
        if len(drop) != len(rows) or any(r < 0 or r >= self.num_rows for r in drop):
            raise ValueError(f"rows must be distinct indices in [0, {self.num_rows}), got {list(rows)}")
        keep = [r for r in range(self.num_rows) if r not in drop]
        if not keep:
            self._reset(0)
            return
        self.select_rows(keep)
        self.maybe_compact()

    def select_rows(self, index: Sequence[int]) -> None:
        """Rows become rows ``index`` of this batch, in that order; a repeated row is copied (every
        copy is an independent row from then on)."""
        self.require_idle("select_rows")
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        for layer in self._kv_layers():
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        self.valid = self.valid.index_select(0, idx)
        self.pos = self.pos.index_select(0, idx)
        self.committed = self.committed.index_select(0, idx)
        self.lengths = [self.lengths[r] for r in index]

    # -- compaction ----------------------------------------------------------------------------

    def maybe_compact(self) -> None:
        """Compact when the reclaimable slots (S minus the longest row) exceed ``compact_fraction``
        of S, or S exceeds ``max_slots``."""
        width = max(self.lengths, default=0)
        if width < self.num_slots and not bool(self.valid[:, width:].any()):
            self._trim(width)  # trailing slots that no row uses (e.g. rejected drafts at R = 1): a slice
        reclaim = self.num_slots - width
        too_long = self.max_slots is not None and self.num_slots > self.max_slots
        if reclaim > 0 and (reclaim > self.compact_fraction * self.num_slots or too_long):
            self.compact()

    def _trim(self, width: int) -> None:
        """Drop slots >= ``width`` (unused by every row) from every layer."""
        for layer in self._kv_layers():
            layer.keys = layer.keys[:, :, :width]
            layer.values = layer.values[:, :, :width]
        self.valid, self.pos = self.valid[:, :width], self.pos[:, :width]

    def compact(self) -> None:
        """Gather each row's valid slots to the left (keys and values of every layer); S becomes
        the longest row's committed length."""
        self.require_idle("compact")
        if self.num_rows == 0:
            return
        width = max(self.lengths)
        order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # [R, S']
        index = order[:, None, :, None]  # [R, 1, S', 1]
        for layer in self._kv_layers():
            layer.keys = layer.keys.gather(2, _expand_like(index, layer.keys))
            layer.values = layer.values.gather(2, _expand_like(index, layer.values))
        self.pos = self.pos.gather(1, order)
        self.valid = torch.arange(width, device=self.device)[None, :] < self.committed[:, None]
        self.num_compactions += 1


class SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends new slots into spare capacity instead of concatenating the
    whole cache on every forward: a step copies its own q slots, not S + q. ``keys`` / ``values``
    stay plain attributes (leading slices of a buffer with spare slots); whatever assigns them
    (the batch's compaction, row selection, trimming) works as with ``DynamicLayer``, and an
    assignment that is not a leading slice of the buffer retires it. When full, the buffer grows
    by an eighth of its slots (at least 64). Tensors under 256 KB (R = 1 at short contexts) are
    concatenated as before: as cheap there, and K/V stay contiguous."""

    GROWTH = 0.125  # spare slots added when full, as a share of the slots in use (at least MIN_SPARE)
    MIN_SPARE = 64
    SMALL = 1 << 18  # bytes: below this a concatenation costs no more than a write into spare slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        assert self.keys is not None and self.values is not None  # set by lazy_initialization
        self.keys, kbuf = self._append(self.keys, self._buffers[0], key_states)
        self.values, vbuf = self._append(self.values, self._buffers[1], value_states)
        self._buffers = (kbuf, vbuf)
        return self.keys, self.values

    def _append(self, cur: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor):
        """cur [R, H, n, D] (or empty) followed by new [R, H, q, D], and the buffer holding it."""
        n, q = (cur.shape[2] if cur.dim() == 4 else 0), new.shape[2]
        if buf is not None and n + q <= buf.shape[2] and _leading_slice(cur, buf):
            buf.narrow(2, n, q).copy_(new)
            return buf.narrow(2, 0, n + q), buf
        if new.nbytes // q * (n + q) < self.SMALL:
            return torch.cat([cur, new], dim=2), None
        grown = new.new_empty(new.shape[0], new.shape[1], n + q + max(int(self.GROWTH * (n + q)), self.MIN_SPARE),
                              new.shape[3])  # fmt: skip
        if n:
            grown.narrow(2, 0, n).copy_(cur)
        grown.narrow(2, n, q).copy_(new)
        return grown.narrow(2, 0, n + q), grown


def _leading_slice(value: torch.Tensor, buf: torch.Tensor) -> bool:
    """``value`` is ``buf[:, :, :k]`` for some k (same storage start, strides and other dims)."""
    return (
        value.dim() == 4 and value.data_ptr() == buf.data_ptr() and value.stride() == buf.stride()
        and value.shape[:2] == buf.shape[:2] and value.shape[3] == buf.shape[3]
    )  # fmt: skip


def _pad_slots(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Right-pad ``x`` with zeros (False) along ``dim`` up to ``width``."""
    extra = width - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _expand_like(index: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Broadcast a slot index [R, 1, S', 1] over the heads and channels of ``kv`` [R, H, S, D]."""
    return index.expand(kv.shape[0], kv.shape[1], index.shape[2], kv.shape[3])


# -- visibility among the new tokens and per-layer-type layout --------------------------------


def causal_visibility(real: torch.Tensor) -> torch.Tensor:
    """[R, q, q] bool: token i sees real tokens j <= i; padding (real False) also sees itself."""
    q = real.shape[1]
    vis = torch.ones(q, q, dtype=torch.bool, device=real.device).tril()[None] & real[:, None, :]
    return vis | torch.eye(q, dtype=torch.bool, device=real.device)


def ancestor_visibility(parents: torch.Tensor) -> torch.Tensor:
    """[R, q, q] bool ancestor-or-self matrix from row-local parents [R, q] (-1 = none).

    Reachability by repeated squaring of (I + parent one-hot): ceil(log2 q) batched matmuls.
    """
    rows, q = parents.shape
    step = torch.zeros(rows, q, q + 1, dtype=torch.float32, device=parents.device)
    step.scatter_(2, torch.where(parents >= 0, parents, q)[..., None], 1.0)
    reach = step[..., :q] + torch.eye(q, device=parents.device)
    span = 1
    while span < q:
        reach = (reach @ reach).clamp(max=1.0)
        span *= 2
    return reach > 0


def attention_layout(config) -> tuple[int | None, str]:
    """(sliding window or None, layout) of a text config. Layout: "full"; "sliding" (every layer:
    no ``layer_types`` but a window, Mistral style); "mixed" (masks go in a per-layer-type dict)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return (window, "sliding") if window else (None, "full")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported attention layer types {sorted(unknown)}")
    if "sliding_attention" not in types:
        return None, "full"
    if not window:
        raise ValueError("config has sliding_attention layers but no sliding_window")
    return window, "mixed"
