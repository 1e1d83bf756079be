"""The target's KV cache: buffers of fixed capacity, written in place, rows addressed by length.

:class:`SlotCache` (a transformers ``Cache``) holds, per decoder layer, keys and values
[row capacity, H, slot capacity, D], allocated once (and grown, rarely, by copying). Row r's
committed tokens sit at slots 0..len_r−1 in order, so a slot *is* the token's RoPE position and
the per-row lengths are the whole bookkeeping: slot j of row r is committed context iff
j < len_r. No validity or position arrays, no holes, no compaction (the model of gpt-fast's
static cache, with one length per row).

A forward of q new tokens per row writes them at slots len_r..len_r+q−1 (copied into the
buffer in place: nothing is concatenated) and its attention reads a leading *window* of S slots of the
buffer, S >= the longest row + q. Windows are rounded up to a bucket when forwards are captured
as CUDA graphs (:mod:`dspec_cli.runtime.graphs`), so shapes repeat, and to the batch's
``window_multiple`` (16 for the batch-invariant attention of dspec's own forward,
:mod:`dspec_cli.runtime.decoder`); else S is exact. Slots at or past len_r are stale: what a
rejected draft or a padding token left there is hidden by the masks (:func:`attention_masks`) and
overwritten later.

Commit: a chain's accepted prefix is already in place, so committing only raises len_r; a
tree's accepted path (node i written at slot len_r + i) is moved down to len_r, len_r+1, ...
(one gather and one scatter per layer). :class:`TargetBatch` keeps the rows' bookkeeping as
every slot cache does (:class:`~dspec_cli.nn.slots.SlotRows`): the device lengths (updated in
place, so a captured graph reads the current values) and a host copy that sizes windows: exact,
or an upper bound after a commit made without reading the device (the engine's rounds), until
``settle``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dspec_cli.nn.slots import SlotRows, write_slots

__all__ = [
    "SlotCache",
    "SlotLayer",
    "TargetBatch",
    "ancestor_visibility",
    "attention_layout",
    "attention_masks",
    "causal_visibility",
    "chain_mask",
]


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
        n = key_states.shape[0]
        all_keys, all_values = self.kv()
        write_slots((all_keys, all_values), io.row0, io.slots, (key_states, value_states))
        rows = slice(io.row0, io.row0 + n)
        return all_keys[rows, :, : io.window], all_values[rows, :, : io.window]

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


class TargetBatch(SlotRows):
    """The KV cache of a batch of requests and the committed length of each row: the slot rows
    (:class:`~dspec_cli.nn.slots.SlotRows`: ``lengths`` on the device, ``bounds`` on the host,
    ``capacity``, ``generation``, ``select_rows``) over the K/V buffers of ``cache``
    (:class:`SlotCache`), the tapped decoder layers ``layer_ids``, whether its forwards attend
    batch-invariantly (``invariant``, dspec's own forward) and ``window_multiple`` (every
    :meth:`window` is a multiple of it: what that attention needs). Built by
    ``Target.new_batch``; all mutation goes through ``Target``.
    """

    def __init__(self, layer_ids: Sequence[int], device: torch.device, rows: int = 0, slots: int = 0,
                 window_multiple: int = 1, invariant: bool = False):
        super().__init__(torch.device(device))
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.window_multiple = window_multiple
        self.invariant = invariant
        self.device = torch.device(device)
        self.cache = SlotCache()
        self.reserve(rows, slots)

    def buffers(self) -> list[torch.Tensor]:
        return [buf for layer in self.cache.kv_layers() for buf in layer.kv()]

    def reserve(self, rows: int, slots: int) -> bool:
        """:meth:`SlotRows.reserve` with one slot more than asked: a window of ``slots`` is then
        always a strict slice of the buffers, so a compiled forward sees one layout (not
        compiled again when a window reaches the capacity)."""
        return super().reserve(rows, slots + 1)

    def _resize(self, rows: int, slots: int) -> None:
        self.cache.resize(rows, slots)

    def window(self, q: int, bucket: int = 1) -> int:
        """Slots a forward of q new tokens per row attends over: the longest row (host bound) + q,
        rounded up to a multiple of ``bucket`` and of ``window_multiple``; the capacity grows to hold it."""
        bucket = math.lcm(bucket, self.window_multiple)
        need = max(self.bounds, default=0) + q
        window = -(-need // bucket) * bucket
        self.reserve(self.num_rows, window)
        return window

    def commit_prefill(self, row0: int, lengths: Sequence[int]) -> None:
        """Rows row0.. now hold prompts of ``lengths`` tokens at slots 0..."""
        self._lengths[row0 : row0 + len(lengths)] = torch.tensor(list(lengths), dtype=torch.long, device=self.device)
        self.bounds[row0 : row0 + len(lengths)] = list(lengths)

    def shift_rows(self, row0: int, shift: torch.Tensor, width: int) -> None:
        """Move the first ``width`` slots of rows row0.. left by ``shift`` [G] (left padding out)."""
        rows = shift.shape[0]
        index = (torch.arange(width, device=self.device) + shift[:, None]).clamp(max=width - 1)  # [G, W]
        for buf in self.buffers():
            part = buf[row0 : row0 + rows, :, :width]
            part.copy_(part.gather(2, index[:, None, :, None].expand(rows, part.shape[1], width, part.shape[3])))

    # -- device bookkeeping (no host reads: what a captured round runs; chains: advance) -------

    def keep_path(self, path: torch.Tensor) -> None:
        """Trees: rows [0, n) keep the nodes of ``path`` [n, D+1] (row-local node ids written at
        slot committed + id, from the root down, -1 padded): they move to committed, committed+1, ..."""
        n, width = path.shape
        used = path >= 0
        base = self._lengths[:n, None]  # [n, 1]
        dst = base + torch.arange(width, device=self.device)
        src = torch.where(used, base + path, dst)  # padding copies a slot onto itself
        for buf in self.buffers():
            rows = buf[:n]
            heads, dim = rows.shape[1], rows.shape[3]
            moved = rows.gather(2, src[:, None, :, None].expand(n, heads, width, dim))
            rows.scatter_(2, dst[:, None, :, None].expand(n, heads, width, dim), moved)
        self._lengths[:n] += used.sum(1)


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


def chain_mask(committed: torch.Tensor, q: int, window: int) -> torch.Tensor:
    """Boolean mask [R, 1, q, window] of causal chains in full-attention layers: new token i of
    row r sees slot s iff s <= committed[r] + i (:func:`attention_masks` of a causal ``vis``, in
    three operations)."""
    last = committed[:, None] + torch.arange(q, device=committed.device)  # [R, q]
    return (torch.arange(window, device=committed.device) <= last[..., None])[:, None]


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
