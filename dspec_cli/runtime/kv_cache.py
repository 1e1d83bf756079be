"""The target's KV cache: buffers of fixed capacity, written in place, rows addressed by length.

:class:`SlotCache` (a transformers ``Cache``) holds, per decoder layer, keys and values
[row capacity, H, slot capacity, D], allocated once (and grown, rarely, by copying). Row r's
committed tokens sit at slots 0..len_r−1 in order, so a slot *is* the token's RoPE position and
the per-row lengths are the whole bookkeeping: slot j of row r is committed context iff
j < len_r. No validity or position arrays, no holes, no compaction (the model of gpt-fast's
static cache, with one length per row).

A forward of q new tokens per row writes them at slots len_r..len_r+q−1 (a scatter into the
buffer: nothing is concatenated) and its attention reads a leading *window* of S slots of the
buffer, S >= the longest row + q. Windows are rounded up to a bucket when forwards are captured
as CUDA graphs (:mod:`dspec_cli.runtime.graphs`), so shapes repeat; on a CPU S is exact. Slots at
or past len_r are stale: what a rejected draft or a padding token left there is hidden by the
masks (:func:`attention_masks`) and overwritten later.

Commit: a chain's accepted prefix is already in place, so committing only raises len_r; a
tree's accepted path (node i written at slot len_r + i) is moved down to len_r, len_r+1, ...
(one gather and one scatter per layer). :class:`TargetBatch` keeps the device lengths (updated
in place, so a captured graph reads the current values) and a host copy that sizes windows:
exact, or an upper bound after a commit made without reading the device (the engine's rounds),
until :meth:`TargetBatch.settle`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = [
    "PendingStep",
    "SlotCache",
    "SlotLayer",
    "TargetBatch",
    "ancestor_visibility",
    "attention_layout",
    "attention_masks",
    "causal_visibility",
]

MIN_SLOTS = 64  # smallest slot capacity allocated
GROWTH = 1.5  # slot capacity grows at least by this factor when exceeded


@dataclass
class PendingStep:
    """The tokens of the last ragged verify, waiting for commit()/commit_path()."""

    n: list[int]  # tokens per row (host copy)
    q: int  # columns of the verified grid (max n)
    parents: torch.Tensor | None  # [R, q] row-local parents (-1: root or padding); None for chains


@dataclass
class ForwardIO:
    """Where the forward being run reads and writes (set on the cache before each forward)."""

    row0: int  # first batch row of the forward's rows
    slots: torch.Tensor  # [n, q] long: slot of each new token
    window: int  # slots returned to attention (a leading window of the buffer)


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values [row capacity, H, slot capacity, D]; see the module
    docstring. Full history is kept for sliding-window layers too (their window is a mask). It
    refers to its cache weakly: no reference cycle, so a dropped cache's buffers are freed at once,
    not by the cycle collector."""

    is_sliding = False
    is_compileable = True

    def __init__(self, cache: SlotCache):
        super().__init__()
        self._cache = weakref.ref(cache)

    @property
    def cache(self) -> SlotCache:
        cache = self._cache()
        assert cache is not None, "SlotLayer used after its SlotCache was dropped"
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the buffers from the first forward's key_states, value_states [n, H, q, D]
        (heads, head size, dtype and device) at the cache's capacity."""
        rows, slots = self.cache.capacity
        self.device = key_states.device
        self.keys = key_states.new_zeros(rows, key_states.shape[1], slots, key_states.shape[3])
        self.values = value_states.new_zeros(rows, value_states.shape[1], slots, value_states.shape[3])
        self.is_initialized = True

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each [row capacity, H, slot capacity, D] (the layer is initialised)."""
        assert self.keys is not None and self.values is not None, "SlotLayer used before its first update"
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens' key_states, value_states [n, H, q, D] at their slots; return the
        window of both [n, H, S, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        io = self.cache.forward_io()
        n, heads, q, _ = key_states.shape
        rows = slice(io.row0, io.row0 + n)
        all_keys, all_values = self.kv()
        keys, values = all_keys[rows], all_values[rows]
        index = io.slots[:, None, :, None]  # [n, 1, q, 1]
        keys.scatter_(2, index.expand(n, heads, q, keys.shape[3]), key_states)
        values.scatter_(2, index.expand(n, values.shape[1], q, values.shape[3]), value_states)
        return keys[:, :, : io.window], values[:, :, : io.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.forward_io().window, 0

    def get_seq_length(self) -> int:
        io = self.cache.io
        return 0 if io is None else io.window - io.slots.shape[1]

    def get_max_length(self) -> int:
        return self.cache.capacity[1]

    def resize(self, rows: int, slots: int) -> None:
        """Grow the buffers to [rows, H, slots, D], keeping their contents."""
        if not self.is_initialized:
            return
        old_rows, _, old_slots, _ = self.kv()[0].shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(rows, old.shape[1], slots, old.shape[3])
            new[:old_rows, :, :old_slots] = old
            setattr(self, name, new)


class SlotCache(Cache):
    """A transformers ``Cache`` of :class:`SlotLayer` s (made on first use, one per layer that
    updates the cache) sharing one capacity and one :class:`ForwardIO`."""

    def __init__(self, rows: int = 0, slots: int = 0):
        super().__init__(layers=[])
        self.capacity = (rows, slots)
        self.io: ForwardIO | None = None

    def forward_io(self) -> ForwardIO:
        """Where the running forward reads and writes (set by the target before every forward)."""
        assert self.io is not None, "SlotCache: a forward ran without its ForwardIO"
        return self.io

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store key_states, value_states [n, H, q, D] of layer ``layer_idx``; return its window."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self))
        layer = self.layers[layer_idx]
        assert isinstance(layer, SlotLayer)  # this cache makes only SlotLayers
        return layer.update(key_states, value_states)

    def kv_layers(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlotLayer) and layer.is_initialized]

    def resize(self, rows: int, slots: int) -> None:
        for layer in self.kv_layers():
            layer.resize(rows, slots)
        self.capacity = (rows, slots)


class TargetBatch:
    """The KV cache of a batch of requests and the committed length of each row.

    Attributes: ``cache`` (:class:`SlotCache`), ``num_rows``, ``committed`` [R] long on the
    device (a view of a buffer updated in place), ``lengths`` (host copy of ``committed``: exact
    when ``exact``, else an upper bound), ``layer_ids`` (tapped decoder layers) and
    ``generation`` (bumped whenever buffers are reallocated: graphs captured before read stale
    memory). Built by ``Target.new_batch``; all mutation goes through ``Target``.
    """

    def __init__(self, layer_ids: Sequence[int], device: torch.device, rows: int = 0, slots: int = 0):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.device = torch.device(device)
        self.cache = SlotCache()
        self._committed = torch.zeros(0, dtype=torch.long, device=self.device)  # [row capacity]
        self.num_rows = 0
        self.lengths: list[int] = []
        self.exact = True
        self.pending: PendingStep | None = None
        self.generation = 0
        self.reserve(rows, slots)

    @property
    def committed(self) -> torch.Tensor:
        """[R] long: committed tokens per row = the next token's slot and RoPE position."""
        return self._committed[: self.num_rows]

    def committed_rows(self, rows: int) -> torch.Tensor:
        """[rows] committed lengths of rows [0, rows): the batch's rows, then padding rows (length 0)
        up to the row capacity."""
        return self._committed[:rows]

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, slots) the buffers hold."""
        return self.cache.capacity

    def require_idle(self, what: str) -> None:
        if self.pending is not None:
            raise ValueError(f"{what}: the last verify has not been committed yet")

    # -- capacity ------------------------------------------------------------------------------

    def reserve(self, rows: int, slots: int) -> bool:
        """Make room for ``rows`` rows of ``slots`` slots; True when the buffers grew (by copying:
        a new ``generation``)."""
        have_rows, have_slots = self.cache.capacity
        if rows <= have_rows and slots <= have_slots:
            return False
        rows = max(rows, have_rows)
        slots = max(slots, int(have_slots * GROWTH), MIN_SLOTS) if slots > have_slots else have_slots
        self.cache.resize(rows, slots)
        committed = torch.zeros(rows, dtype=torch.long, device=self.device)
        committed[: self._committed.shape[0]] = self._committed
        self._committed = committed
        self.generation += 1
        return True

    def window(self, q: int, bucket: int = 1) -> int:
        """Slots a forward of q new tokens per row attends over: the longest row (host bound) + q,
        rounded up to a multiple of ``bucket``; the capacity grows to hold it."""
        need = max(self.lengths, default=0) + q
        window = -(-need // bucket) * bucket
        self.reserve(self.num_rows, window)
        return window

    # -- host bookkeeping ----------------------------------------------------------------------

    def settle(self, lengths: Sequence[int]) -> None:
        """The exact committed lengths, read by the caller after sync-free commits."""
        if len(lengths) != self.num_rows:
            raise ValueError(f"settle: expected {self.num_rows} lengths, got {len(lengths)}")
        self.lengths, self.exact = [int(n) for n in lengths], True

    def bound(self, grown: int) -> None:
        """Every row may have grown by up to ``grown`` tokens (a commit the host did not read)."""
        self.lengths = [n + grown for n in self.lengths]
        self.exact = False

    def add_rows(self, count: int, slots: int) -> int:
        """``count`` empty rows join at the end (room for ``slots`` slots); returns the first."""
        first = self.num_rows
        self.reserve(first + count, slots)
        self._committed[first : first + count] = 0
        self.num_rows += count
        self.lengths += [0] * count
        return first

    def commit_prefill(self, row0: int, lengths: Sequence[int]) -> None:
        """Rows row0.. now hold prompts of ``lengths`` tokens at slots 0..."""
        self._committed[row0 : row0 + len(lengths)] = torch.tensor(list(lengths), dtype=torch.long, device=self.device)
        self.lengths[row0 : row0 + len(lengths)] = list(lengths)

    def shift_rows(self, row0: int, shift: torch.Tensor, width: int) -> None:
        """Move the first ``width`` slots of rows row0.. left by ``shift`` [G] (left padding out)."""
        rows = shift.shape[0]
        index = (torch.arange(width, device=self.device) + shift[:, None]).clamp(max=width - 1)  # [G, W]
        for layer in self.cache.kv_layers():
            for buf in layer.kv():
                part = buf[row0 : row0 + rows, :, :width]
                part.copy_(part.gather(2, index[:, None, :, None].expand(rows, part.shape[1], width, part.shape[3])))

    def select_rows(self, index: Sequence[int]) -> None:
        """Rows become rows ``index`` of this batch, in that order; a repeated row is copied (every
        copy is an independent row from then on). Only rows that change place are copied."""
        self.require_idle("select_rows")
        index = [int(i) for i in index]
        if any(not 0 <= i < self.num_rows for i in index):
            raise ValueError(f"rows must be indices in [0, {self.num_rows}), got {index}")
        self.reserve(len(index), 0)
        moved = [r for r, i in enumerate(index) if r != i]
        if moved:
            dst = torch.tensor(moved, dtype=torch.long, device=self.device)
            src = torch.tensor([index[r] for r in moved], dtype=torch.long, device=self.device)
            for layer in self.cache.kv_layers():
                for buf in layer.kv():
                    buf.index_copy_(0, dst, buf.index_select(0, src))
            self._committed.index_copy_(0, dst, self._committed.index_select(0, src))
        self._committed[len(index) : self.num_rows] = 0  # rows that left: zero length (padding rows)
        self.lengths = [self.lengths[i] for i in index]
        self.num_rows = len(index)

    # -- device bookkeeping (no host reads: what a captured round runs) -------------------------

    def advance(self, keep: torch.Tensor) -> None:
        """Chains: rows [0, n) keep ``keep`` [n] more tokens (already in place at their slots)."""
        self._committed[: keep.shape[0]] += keep

    def keep_path(self, path: torch.Tensor) -> None:
        """Trees: rows [0, n) keep the nodes of ``path`` [n, D+1] (row-local node ids written at
        slot committed + id, from the root down, -1 padded): they move to committed, committed+1, ..."""
        n, width = path.shape
        used = path >= 0
        base = self._committed[:n, None]  # [n, 1]
        dst = base + torch.arange(width, device=self.device)
        src = torch.where(used, base + path, dst)  # padding copies a slot onto itself
        for layer in self.cache.kv_layers():
            for buf in layer.kv():
                rows = buf[:n]
                heads, dim = rows.shape[1], rows.shape[3]
                moved = rows.gather(2, src[:, None, :, None].expand(n, heads, width, dim))
                rows.scatter_(2, dst[:, None, :, None].expand(n, heads, width, dim), moved)
        self._committed[:n] += used.sum(1)


def attention_masks(
    committed: torch.Tensor,  # [R] committed length of each row
    pos_q: torch.Tensor,  # [R, q] positions of the new tokens (written at slots committed + 0..q-1)
    vis: torch.Tensor,  # [R, q, q] bool: new token i sees new token j
    window: int,
    sliding: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks [R, 1, q, window] (True = attend) for full and sliding-window layers: each new
    token sees its row's committed slots and the new tokens ``vis`` allows; a sliding window
    counts positions (a committed slot's position is its index)."""
    rows, q = pos_q.shape
    slot = torch.arange(window, device=pos_q.device)
    rel = slot[None, :] - committed[:, None]  # [R, S]: which new token a slot holds (0 <= rel < q)
    new = (rel >= 0) & (rel < q)
    col = rel.clamp(0, q - 1)
    seen_new = vis.gather(2, col[:, None, :].expand(rows, q, window))  # [R, q, S]
    full = torch.where(new[:, None, :], seen_new, (rel < 0)[:, None, :])
    if sliding is None:
        return full[:, None], None
    key_pos = torch.where(new, pos_q.gather(1, col), slot[None, :])  # [R, S]
    near = (pos_q[:, :, None] - key_pos[:, None, :]) < sliding
    return full[:, None], (full & near)[:, None]


# -- visibility among the new tokens and per-layer-type layout --------------------------------


def causal_visibility(real: torch.Tensor) -> torch.Tensor:
    """[R, q, q] bool from real [R, q] bool: token i sees real tokens j <= i; padding (real False)
    also sees itself."""
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
