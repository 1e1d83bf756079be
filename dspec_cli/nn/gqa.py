"""Grouped-query attention under a mask without copying K/V: the query heads that share a KV
head are stacked along the query axis.

On CUDA, SDPA's flash kernel takes no mask and, in the torch the GPU runs used (2.11), the
memory-efficient kernel takes no grouped heads (PyTorch ``aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp``, ``can_use_mem_efficient_attention``; newer versions add them): ``enable_gqa=True``
with a mask falls back to the math kernel, which expands K/V per query head and computes fp32
scores, and transformers' ``sdpa`` attention avoids that by repeating K/V itself (``repeat_kv``, a
copy of the cache per layer and step; its one-token shortcut ``pack_gqa`` exists only in recent
versions and not under ``torch.compile``). Reshaping query [B, H, q, d] to [B, H_kv, n·q, d] (query head h
reads KV head h // n, the grouping of transformers and of ``enable_gqa``) gives the same
attention with equal head counts, so the memory-efficient kernel (or cuDNN's) takes it and K/V
are read in place; the mask's rows repeat to match (a view when the mask has one query row).

No split-KV (flash-decoding) kernel: at B = 1 a one-token step gives SDPA H_kv (batch, head)
pairs of one query block each, a few programs per layer reading the whole context. For a
Qwen3-4B shape (36 layers, 8 KV heads of 128, bf16; 8.0 GB of weights) that context is 75 MB at
512 tokens, 0.9 % of the step's bytes: even read at a tenth of the bandwidth it adds 8 % to the
step. At 4,096 tokens it is 604 MB, 7 %, and the same tenth would add 63 %. ``benchmarks.gpu``'s
``attention`` part times one layer at both contexts against reading its K/V: a split-KV kernel is
worth its code where that ratio is far above 1 at long contexts.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

__all__ = ["sdpa_stacked"]

# the last stacked masks: every layer of a forward passes the same mask (one per layer type), so
# each is stacked once
_RECENT: list[tuple[weakref.ref, int, torch.Tensor]] = []  # (the mask, groups, stacked), newest first
_KEEP = 4


def sdpa_stacked(
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, H_kv, S, d], H = n·H_kv
    value: torch.Tensor,  # [B, H_kv, S, d_v]
    mask: torch.Tensor | None,  # [B or 1, 1, q or 1, S] bool (True = attend) or None
    *,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA of ``query`` over ``key``/``value`` under ``mask`` -> [B, H, q, d_v], one call with
    H_kv heads (module docstring). The query is copied when it is not contiguous over its
    heads and positions (a transpose: q tokens per row, cheap); K, V are not."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * q_len, dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=stacked_mask(mask, groups), dropout_p=dropout,
                                         scale=scale)
    return out.view(batch, heads, q_len, out.shape[-1])


def stacked_mask(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """mask [B, 1, q, S] with each query row repeated for the ``groups`` stacked heads:
    [B, 1, groups·q, S] (made once per mask: the layers of a forward share it; outside
    ``torch.compile``, whose graph computes it once anyway), or the mask itself when it has one
    query row (broadcast)."""
    if mask is None or mask.shape[2] == 1 or groups == 1:
        return mask
    memo = not torch.compiler.is_compiling()
    for ref, n, stacked in _RECENT if memo else ():
        if ref() is mask and n == groups:
            return stacked
    batch, _, q_len, slots = mask.shape
    stacked = mask[:, :, None].expand(batch, 1, groups, q_len, slots).reshape(batch, 1, groups * q_len, slots)
    if memo:
        _RECENT[:] = [(weakref.ref(mask), groups, stacked), *_RECENT[: _KEEP - 1]]
    return stacked
