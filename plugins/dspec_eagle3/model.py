"""The EAGLE-3 draft network: feature fusion, one decoder layer, draft-vocabulary LM head.

Position t of the draft reads g_t and the next token x_{t+1} and predicts x_{t+2}:

    g_t  = fc([h_low; h_mid; h_high]_t)        (step 0: target taps, n·d -> d, no bias)
           or the draft's own output at t      (later steps / later drafts)
    a_t  = [embed_norm(embed(x_{t+1})); hidden_norm(g_t)]          width 2d
    u_t  = g_t + o_proj(attn(q, k, v from a_t))                    residual stream is g_t
    o_t  = u_t + mlp(post_attention_layernorm(u_t))                the next step's g
    logits_t = lm_head(norm(o_t))                                  over the draft vocabulary

Attention is Qwen3-style (GQA, q/k RMSNorm per head, RoPE; ``qk_norm=False`` drops the q/k
norms, as SpecForge's Llama EAGLE-3); the layer's q/k/v projections read the 2d-wide a_t.
The shared pieces (RMSNorm, Rotary, MLP) come from :mod:`dspec_cli.nn.backbone`. The target's
embedding is not part of this module.

Reduced draft vocabulary (EAGLE's d2t/t2d): the LM head scores N < V target ids; ``d2t``
[N] holds offsets, ``target_id = draft_id + d2t[draft_id]``, and is saved with the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from dspec_cli.nn import (
    MLP,
    BackboneConfig,
    Linear,
    RMSNorm,
    Rotary,
    apply_rotary,
    attend,
)

__all__ = ["Eagle3Net", "build_vocab_mapping", "ttt_attention_mask"]


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target ids (ties: lower id first), sorted.

    token_counts [V] -> (d2t [N] long offsets with target_id = draft_id + d2t[draft_id],
    t2d [V] bool: target id is in the draft vocabulary). Ids never seen fill up the set in id
    order, so N = ``draft_vocab_size`` always.
    """
    if token_counts.dim() != 1:
        raise ValueError(f"token_counts must be [V], got shape {tuple(token_counts.shape)}")
    vocab = token_counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}], got {draft_vocab_size}")
    order = torch.sort(token_counts.double(), descending=True, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size, device=used.device)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=used.device)
    t2d[used] = True
    return d2t, t2d


def ttt_attention_mask(key_valid: torch.Tensor, step: int, impl: str = "dense"):
    """Training-time-test mask of step ``step`` over keys [step-0 L | step-1 L | ... | step L].

    Query t sees the valid step-0 keys s <= t and the key at the same index t of every later
    step (its own earlier drafts); the diagonal is always visible, so no row is empty.
    key_valid [b, L] bool (padding = False) -> a dense bool mask [b, 1, L, (step+1)·L] for SDPA
    (``impl="dense"``) or a FlexAttention ``BlockMask`` (``"flex"``).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if impl not in ("dense", "flex"):
        raise ValueError(f"impl must be dense or flex, got {impl!r}")
    b, L = key_valid.shape

    def mask_mod(bi, h, q, kv):
        return (kv % L == q) | ((kv < L) & (kv <= q) & key_valid[bi, kv % L])

    dev = key_valid.device
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mask_mod, b, None, L, (step + 1) * L, device=dev)
    bi = torch.arange(b, device=dev)[:, None, None, None]
    q = torch.arange(L, device=dev)[None, None, :, None]
    kv = torch.arange((step + 1) * L, device=dev)[None, None, None, :]
    return mask_mod(bi, None, q, kv)


class FusedAttention(nn.Module):
    """Queries, keys and values from the 2d-wide fused input; output width d. Per-head q/k
    RMSNorm (Qwen3 style) unless ``qk_norm`` is False (Llama style, as SpecForge's EAGLE-3)."""

    def __init__(self, cfg: BackboneConfig, qk_norm: bool = True):
        super().__init__()
        d, hd, bias = cfg.hidden_size, cfg.head_dim, bool(cfg.attention_bias)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = Linear(2 * d, self.heads * hd, bias=bias)
        self.k_proj = Linear(2 * d, self.kv_heads * hd, bias=bias)
        self.v_proj = Linear(2 * d, self.kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else nn.Identity()

    def project_kv(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a [..., 2d], cos/sin [..., hd] -> post-RoPE K and V [..., Hkv, hd]."""
        shape = (*a.shape[:-1], self.kv_heads, self.head_dim)
        return apply_rotary(self.k_norm(self.k_proj(a).view(shape)), cos, sin), self.v_proj(a).view(shape)

    def forward(self, a, cos, sin, keys, values, mask) -> torch.Tensor:
        """a [b, Q, 2d], cos/sin [b, Q, hd], keys/values [b, Hkv, S, hd] (the queries' own keys
        included), mask [b, 1, Q, S] bool or a FlexAttention BlockMask -> [b, Q, d]."""
        b, q_len, _ = a.shape
        q = apply_rotary(self.q_norm(self.q_proj(a).view(b, q_len, self.heads, self.head_dim)), cos, sin)
        out = attend(q.transpose(1, 2), keys, values, mask, gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class Eagle3Net(nn.Module):
    """Trainable EAGLE-3 weights (see the module docstring). ``draft_vocab`` = N (V if full)."""

    def __init__(self, cfg: BackboneConfig, num_taps: int, draft_vocab: int, reduced: bool, qk_norm: bool = True):
        super().__init__()
        d = cfg.hidden_size
        self.fc = Linear(num_taps * d, d, bias=False)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = FusedAttention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = Linear(d, draft_vocab, bias=False)
        self.rotary = Rotary(cfg)
        if reduced:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        else:
            self.d2t = None
        std = cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def draft_ids(self) -> torch.Tensor | None:
        """Target id of every draft id [N], or None for the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps [..., n·d] -> g [..., d]."""
        return self.fc(taps.to(self.dtype))

    def inputs(self, embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Token embeddings and g [..., d] -> the layer input a [..., 2d]."""
        return torch.cat([self.embed_norm(embeds.to(self.dtype)), self.hidden_norm(g)], dim=-1)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, self.dtype)

    def project_kv(self, a: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return self.self_attn.project_kv(a, cos, sin)

    def layer(self, a, g, cos, sin, keys, values, mask) -> torch.Tensor:
        """One decoder layer: queries from a [b, Q, 2d], residual g [b, Q, d] -> o [b, Q, d]."""
        u = g + self.self_attn(a, cos, sin, keys, values, mask)
        return u + self.mlp(self.post_attention_layernorm(u))

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """o [..., d] -> float logits over the draft vocabulary [..., N]."""
        return self.lm_head(self.norm(o)).float()
