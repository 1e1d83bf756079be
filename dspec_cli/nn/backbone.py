"""The parallel block backbone shared by DFlash and DSpark (DeepSpec ``deepspec/modeling/dspark/common.py``,
``deepspec/modeling/dspark/qwen3/modeling.py``).

Qwen3-style decoder layers (q/k RMSNorm, SwiGLU MLP, RoPE) with *KV injection*: target hidden
taps of committed tokens are fused by ``fc`` (n·d → d, no bias) and ``hidden_norm`` into
H_ctx, projected by each layer's own k/v projections (k_norm on K, no extra norm on H_ctx)
and prepended to the block's keys and values. H_ctx never enters the residual stream.

``layer_style = "gemma4"`` gives DeepSpec's Gemma-4 draft layers instead (DeepSpec ``deepspec/modeling/dspark/gemma4/modeling.py``
"Gemma4 deltas", ``Gemma4DSparkDecoderLayer``): Gemma-4 RMSNorms (plain weight, float math),
a scale-free RMSNorm on V, attention scale 1, optionally V = the K projection
(``attention_k_eq_v``: no ``v_proj``, V is the raw K projection before k_norm, then the V
norm; no RoPE on V), sandwich norms (``post_attention_layernorm`` on the attention output,
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP) and a
``layer_scalar`` buffer multiplying the layer output. Head dim and KV heads are the target's
*global* (full-attention) ones and RoPE its full-attention parameters. KV injection is
unchanged (with k_eq_v the context's V also comes from the K projection, then the V norm).

A block is B input slots at positions a..a+B−1, a = the anchor's position. Queries come only
from the block; a block sees the context strictly before its anchor (the anchor's own target
hidden state does not exist at inference) and all of its own slots (bidirectional).

* Inference: :class:`ContextCache` keeps the post-RoPE context K/V of every layer for R rows
  with per-row lengths; :meth:`ParallelBackbone.forward_block` attends to the cache plus the
  block and never stores the block's K/V; :meth:`ParallelBackbone.extend_cache` appends the
  taps of newly committed tokens.
* Training: :func:`sample_anchors` and :func:`build_blocks` lay out N blocks per sequence;
  :meth:`ParallelBackbone.forward_train` runs them at once under the block-sparse mask of
  :func:`training_mask` (a dense bool mask for SDPA, or a FlexAttention ``BlockMask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from dspec_cli.core.errors import DspecError
from dspec_cli.core.host import reads_free
from dspec_cli.nn.gqa import sdpa_stacked
from dspec_cli.nn.linear import Linear
from dspec_cli.nn.slots import SlotRows, write_slots

__all__ = [
    "BackboneConfig",
    "Blocks",
    "ContextCache",
    "ParallelBackbone",
    "build_blocks",
    "build_target_layer_ids",
    "max_context",
    "resolve_backbone_config",
    "sample_anchors",
    "training_mask",
]


@dataclass
class BackboneConfig:
    """Architecture of the backbone. Zero / empty / None fields are copied from the target."""

    num_layers: int = 5
    hidden_size: int = 0  # must equal the target's (embedding and LM head are shared)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    hidden_act: str = ""
    rms_norm_eps: float = 0.0
    rope_parameters: dict | None = None  # {"rope_type", "rope_theta", ...} (transformers 5 style)
    max_position_embeddings: int = 0
    attention_bias: bool | None = None
    initializer_range: float = 0.0
    layer_style: str = ""  # qwen3 | gemma4; "" = gemma4 on a Gemma-4 target (if supported), else qwen3
    attention_k_eq_v: bool | None = None  # gemma4 only: V reuses the K projection (None = the target's)

    # The layer styles the model built from this config implements (ParallelBackbone: both).
    LAYER_STYLES: ClassVar[tuple[str, ...]] = ("qwen3",)


LAYER_STYLES = ("qwen3", "gemma4")
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: one per draft layer, evenly spaced from layer 1 to L−3 (Qwen3-8B,
    5 layers: 1, 9, 17, 25, 33). Targets with L ≤ 4 layers space them over 0..L−1; repeated
    ids are dropped, so a shallow target may give fewer taps than draft layers."""
    L, n = num_target_layers, num_draft_layers
    if L < 1 or n < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_draft_layers >= 1, got {L}, {n}")
    if n == 1:
        return (L // 2,)
    lo, hi = (1, L - 3) if L > 4 else (0, L - 1)
    return tuple(sorted({lo + round(i * (hi - lo) / (n - 1)) for i in range(n)}))


def _rope_parameters(tc) -> dict:
    """The target's RoPE for the draft layers. A ``partial_rotary_factor`` (GPT-NeoX, Phi) is left
    out: the draft rotates whole heads (only Gemma 4's ``proportional`` RoPE encodes its factor in
    the frequencies it computes), so what the config says is what the layers compute."""
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type (Gemma 3)
    if not params:
        params = {"rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
    params = dict(params)
    if params.get("rope_type", "default") != "proportional":
        params.pop("partial_rotary_factor", None)
    return params


def max_context(config) -> int | None:
    """A transformers text config's context length (``max_position_embeddings``), as the target
    reports it (``Target.max_context``); None when it states none (the config classes of some
    architectures lack the field)."""
    return getattr(config, "max_position_embeddings", None) or None


def _attr(tc, name: str, default=None):
    """``tc.name``, or its global value when transformers refuses the access because the field
    varies per layer (Gemma 4's ``head_dim`` / ``num_key_value_heads`` under per-layer configs)."""
    try:
        return getattr(tc, name, default)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        value = tc.to_dict().get(name)
        return default if value is None else value


def _gemma4_attention(tc, k_eq_v: bool) -> tuple[int | None, int | None]:
    """A Gemma-4 text config's full-attention (global) head dim and, with k_eq_v, its global KV
    heads: ``global_head_dim`` / ``num_global_key_value_heads`` attributes (older transformers),
    else the ``per_layer_config`` of a full-attention layer (transformers 5.2x); None if absent."""
    head_dim = _attr(tc, "global_head_dim")
    kv = _attr(tc, "num_global_key_value_heads") if k_eq_v else None
    try:
        view = tc.per_layer_config["full_attention"]
    except Exception:  # noqa: BLE001 - no per-layer configs (not a Gemma-4 config, or no full layer)
        view = None
    head_dim = head_dim or getattr(view, "head_dim", None)
    if k_eq_v:
        kv = kv or getattr(view, "num_key_value_heads", None)
    return head_dim, kv


def resolve_backbone_config(cfg: BackboneConfig, text_config) -> dict[str, Any]:
    """Field values with target-derived defaults filled in (as DeepSpec copies the target config).

    Raises DspecError when ``hidden_size`` is set and differs from the target's, or for a
    ``layer_style`` the config's model does not implement.
    """
    tc = text_config
    d = tc.hidden_size
    if cfg.hidden_size and cfg.hidden_size != d:
        raise DspecError(f"drafter hidden size {cfg.hidden_size} does not match the target's {d}")
    gemma4_target = getattr(tc, "model_type", None) in GEMMA4_MODEL_TYPES
    style = cfg.layer_style or ("gemma4" if gemma4_target and "gemma4" in cfg.LAYER_STYLES else "qwen3")
    if style not in cfg.LAYER_STYLES:
        supported = ", ".join(cfg.LAYER_STYLES)
        raise DspecError(f"layer_style {style!r} is not supported by this drafter (supported: {supported})")
    heads = cfg.num_attention_heads or tc.num_attention_heads
    kv_heads, head_dim, k_eq_v = _attr(tc, "num_key_value_heads"), _attr(tc, "head_dim"), False
    if style == "gemma4":
        k_eq_v = cfg.attention_k_eq_v
        if k_eq_v is None:
            k_eq_v = bool(_attr(tc, "attention_k_eq_v", False))
        global_dim, global_kv = _gemma4_attention(tc, k_eq_v)
        head_dim, kv_heads = global_dim or head_dim, global_kv or kv_heads
    elif cfg.attention_k_eq_v:
        raise DspecError("attention_k_eq_v = true needs layer_style = 'gemma4'")
    act = (cfg.hidden_act or getattr(tc, "hidden_act", None) or getattr(tc, "hidden_activation", None)
           or getattr(tc, "activation_function", None) or "silu")  # GPT-2 spells it activation_function
    bias = cfg.attention_bias if cfg.attention_bias is not None else bool(getattr(tc, "attention_bias", False))
    return dict(
        layer_style=style,
        attention_k_eq_v=k_eq_v,
        hidden_size=d,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_key_value_heads or kv_heads or heads,
        head_dim=cfg.head_dim or head_dim or d // heads,
        intermediate_size=cfg.intermediate_size or getattr(tc, "intermediate_size", None) or 4 * d,  # GPT-2: 4d
        hidden_act=act,
        rms_norm_eps=cfg.rms_norm_eps or float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(cfg.rope_parameters) if cfg.rope_parameters else _rope_parameters(tc),
        max_position_embeddings=cfg.max_position_embeddings or max_context(tc) or 32768,
        attention_bias=bias,
        initializer_range=cfg.initializer_range or float(getattr(tc, "initializer_range", 0.02)),
    )


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # float math, rounded to x's dtype, then the weight (Qwen3's order); torch's fused kernel
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * y.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: float math, plain ``weight`` (not 1 + w), or no weight at all
    (``scale=False``, the V norm); the same operations as transformers' ``Gemma4RMSNorm``."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def _norm(cfg: BackboneConfig, dim: int) -> nn.Module:
    """The RMSNorm of the config's layer style."""
    return GemmaRMSNorm(dim, cfg.rms_norm_eps) if cfg.layer_style == "gemma4" else RMSNorm(dim, cfg.rms_norm_eps)


class Rotary(nn.Module):
    """RoPE cos/sin for absolute positions; ``inv_freq`` stays float32 under dtype casts.

    Decoding on a CPU looks the values up in a table of every position so far (per dtype, grown
    by doubling): the same numbers, two gathers instead of a dozen small ops per call."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        params = dict(cfg.rope_parameters or {})
        kind = params.get("rope_type", "default")
        hd = cfg.head_dim
        if kind in ("default", "dynamic"):
            theta = float(params.get("rope_theta", 10000.0))
            inv, self.scale = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd), 1.0
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            conf = Qwen3Config(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=hd,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=params,
            )
            inv, self.scale = ROPE_INIT_FUNCTIONS[kind](conf, None)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, dtype) -> cos, sin [P, hd]

    def _apply(self, fn, recurse=True):
        inv = self.inv_freq
        out = super()._apply(fn, recurse)
        self.inv_freq = inv.to(self.inv_freq.device)
        self._tables = {}
        return out

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] long -> cos, sin [..., head_dim]."""
        if torch.is_grad_enabled() or not reads_free(positions):  # the table's size needs a host read
            return self._compute(positions, dtype)
        key = (positions.device, dtype)
        tables = self._tables.get(key)
        need = int(positions.max()) + 1 if positions.numel() else 0
        if tables is None or need > tables[0].shape[0]:
            size = max(need, 2 * tables[0].shape[0] if tables is not None else 256)
            tables = self._tables[key] = self._compute(torch.arange(size, device=positions.device), dtype)
        cos, sin = tables
        return cos[positions], sin[positions]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, hd] rotated by cos/sin [..., hd] (broadcast over heads)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[..., None, :] + torch.cat([-x2, x1], dim=-1) * sin[..., None, :]


class InjectedAttention(nn.Module):
    """Block queries over [context K/V ; block K/V] (GQA, q/k RMSNorm, RoPE). Gemma-4 style adds
    a scale-free V norm and attention scale 1, and with ``attention_k_eq_v`` has no ``v_proj``."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        d, hd, bias = cfg.hidden_size, cfg.head_dim, bool(cfg.attention_bias)
        gemma = cfg.layer_style == "gemma4"
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = Linear(d, self.heads * hd, bias=bias)
        self.k_proj = Linear(d, self.kv_heads * hd, bias=bias)
        self.v_proj = None if gemma and cfg.attention_k_eq_v else Linear(d, self.kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.heads * hd, d, bias=bias)
        self.q_norm = _norm(cfg, hd)
        self.k_norm = _norm(cfg, hd)
        self.v_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, scale=False) if gemma else None
        self.scale = 1.0 if gemma else None  # None: SDPA's 1/sqrt(hd)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d], cos/sin [..., hd] -> post-RoPE K and V [..., Hkv, hd]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        raw = self.k_proj(x).view(shape)
        k = apply_rotary(self.k_norm(raw), cos, sin)
        v = raw if self.v_proj is None else self.v_proj(x).view(shape)  # k_eq_v: V = the raw K projection
        return k, (v if self.v_norm is None else self.v_norm(v))

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask) -> torch.Tensor:
        """x [b, Q, d], cos/sin [b, Q, hd], k_ctx/v_ctx [b, Hkv, C, hd], mask [b, 1, Q, C+Q] bool,
        None (every key visible) or a FlexAttention BlockMask -> [b, Q, d]."""
        b, q_len, _ = x.shape
        q = apply_rotary(self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = torch.cat([k_ctx, k.transpose(1, 2)], dim=2)
        v = torch.cat([v_ctx, v.transpose(1, 2)], dim=2)
        out = attend(q.transpose(1, 2), k, v, mask, gqa=self.heads != self.kv_heads, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


_FLEX = {}


def attend(q, k, v, mask, gqa: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of q [b, H, Q, hd] over k, v [b, Hkv, K, hd] (``gqa``: H a multiple of Hkv) under
    a bool mask [b, 1, Q, K] (SDPA; None: every key visible) or a BlockMask (flex) -> [b, H, Q, hd];
    ``scale`` None = 1/sqrt(head_dim). On CUDA, grouped heads under a mask stack their queries
    (:func:`~dspec_cli.nn.gqa.sdpa_stacked`): SDPA's fused kernels take that layout, where
    ``enable_gqa`` with a mask falls back to the math kernel. A CPU's SDPA takes grouped heads under
    a mask natively, so CPUs keep that call (and their numbers)."""
    if isinstance(mask, torch.Tensor) and gqa and q.is_cuda:
        return sdpa_stacked(q, k, v, mask, scale=scale)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:  # compiled once per process; eager flex (CPU tests) is the reference math
        flex_attention = _FLEX.setdefault("compiled", torch.compile(flex_attention))
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)


class MLP(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        d, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, m, bias=False)
        self.up_proj = Linear(d, m, bias=False)
        self.down_proj = Linear(m, d, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer (Qwen3); Gemma-4 style: sandwich norms and ``layer_scalar``."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        d = cfg.hidden_size
        self.sandwich = cfg.layer_style == "gemma4"
        self.input_layernorm = _norm(cfg, d)
        self.self_attn = InjectedAttention(cfg)
        self.post_attention_layernorm = _norm(cfg, d)  # Qwen3: before the MLP; Gemma 4: on the attention output
        self.mlp = MLP(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(cfg, d)
            self.post_feedforward_layernorm = _norm(cfg, d)
            self.register_buffer("layer_scalar", torch.ones(1))  # persistent: DeepSpec saves it

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask) -> torch.Tensor:
        """x [b, Q, d] -> [b, Q, d]; the other arguments as in :meth:`Attention.forward`."""
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask))
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x * self.layer_scalar
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------
# Inference cache
# --------------------------------------------------------------------------------------


class ContextCache(SlotRows):
    """Post-RoPE context K/V per layer for R rows: ``keys[l]``, ``values[l]`` [R, Hkv, S, hd], views
    of buffers with room for more rows and slots that are updated in place (a captured CUDA graph
    keeps reading the current values); the rows' bookkeeping is the slot cache's
    (:class:`~dspec_cli.nn.slots.SlotRows`: ``lengths``, host ``bounds``, ``reserve``,
    ``generation``, ``select_rows``).

    Slot j of row r holds position j; slots at or past ``lengths[r]`` are stale. Only committed
    context is ever written (the block's K/V are not). The host bounds size writes and attention
    windows without a device read.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype):
        super().__init__(torch.device(device))
        empty = torch.zeros(0, kv_heads, 0, head_dim, device=device, dtype=dtype)
        self._keys = [empty] * num_layers
        self._values = [empty] * num_layers
        self._fixed: int | None = None  # window fixed for the next forwards (fix_window)

    def buffers(self) -> list[torch.Tensor]:
        return self._keys + self._values

    def _resize(self, rows: int, slots: int) -> None:
        def grow(t):
            out = t.new_zeros(rows, t.shape[1], slots, t.shape[3])
            out[: t.shape[0], :, : t.shape[2]] = t
            return out

        self._keys, self._values = [grow(t) for t in self._keys], [grow(t) for t in self._values]

    def _changed(self) -> None:
        self._fixed = None

    @property
    def keys(self) -> list[torch.Tensor]:
        return [t[: self.num_rows] for t in self._keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [t[: self.num_rows] for t in self._values]

    def slots(self, counts: torch.Tensor, total: int, max_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and positions [total] of ``counts[r]`` new entries per row, flattened in row order
        (``total`` = Σcounts, ``max_count`` >= max counts); grows the capacity if needed."""
        dev = self._lengths.device
        rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=dev), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        pos = self._lengths[rows] + torch.arange(total, device=dev) - starts[rows]
        if max(self.bounds, default=0) + max_count > self.capacity[1]:
            self.settle((self.lengths + counts).tolist())  # one sync, on growth only
            self.reserve(self.num_rows, max(self.bounds, default=0))
        else:
            self.bound(max_count)
        return rows, pos

    def write(self, rows, pos, kv: list[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor) -> None:
        """Store kv, per layer (K, V) [N, Hkv, hd], at (rows, pos) [N] from :meth:`slots`; counts [R]
        new entries per row."""
        for keys, values, (k, v) in zip(self._keys, self._values, kv, strict=True):
            keys[rows, :, pos] = k.to(keys.dtype)
            values[rows, :, pos] = v.to(values.dtype)
        self.advance(counts)
        self._fixed = None

    def write_grid(self, pos: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor) -> None:
        """Store kv, per layer (K, V) [n, W, Hkv, hd], at positions pos [n, W] (each row's length + 0..W-1)
        of rows [0, n), of which the first ``counts`` [n] per row become context (no host reads)."""
        for keys, values, (k, v) in zip(self._keys, self._values, kv, strict=True):
            write_slots((keys, values), 0, pos, (k.transpose(1, 2), v.transpose(1, 2)))
        self.advance(counts)
        self._fixed = None

    def visible(self) -> torch.Tensor:
        """[R, S] bool: slots that hold committed context."""
        return torch.arange(self.capacity[1], device=self._lengths.device)[None, :] < self.lengths[:, None]

    def window(self) -> int:
        """Slots attention reads: as :meth:`fix_window` fixed it, else the longest row (exact where
        reading it is free, else the host bound)."""
        if self._fixed is not None:
            return self._fixed
        if reads_free(self._lengths):
            return int(self.lengths.max()) if self.num_rows else 0
        return min(max(self.bounds, default=0), self.capacity[1])

    def fix_window(self, bucket: int) -> int:
        """Fix the window of the next forwards (until a write): the longest row (exact where
        reading it is free, else the host bound rounded up to ``bucket``), so a captured or
        compiled forward reads no host state that changes from round to round."""
        self._fixed = None
        window = self.window()
        if not reads_free(self._lengths):
            window = min(-(-window // bucket) * bucket, self.capacity[1])
        self._fixed = window
        return window

    def context(self, rows: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """Per-layer K/V of rows [0, rows) (default R; more: padding rows) cut to :meth:`window`,
        [rows, Hkv, S', hd] each, and the visibility [rows, S'] bool; None when every slot is
        visible (one row whose exact length is a free host read: attention needs no mask)."""
        rows = self.num_rows if rows is None else rows
        width = self.window()
        keys = [t[:rows, :, :width] for t in self._keys]
        values = [t[:rows, :, :width] for t in self._values]
        if rows == 1 and self.num_rows == 1 and reads_free(self._lengths):
            return keys, values, None
        return keys, values, torch.arange(width, device=self._lengths.device)[None, :] < self._lengths[:rows, None]


# --------------------------------------------------------------------------------------
# Training layout
# --------------------------------------------------------------------------------------


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` anchors per sequence, uniform without replacement among positions
    i <= L−2 with loss_mask[i] = loss_mask[i+1] = 1; sorted ascending.

    loss_mask [b, L] -> anchors [b, N] long, keep [b, N] bool (False = dummy anchor at 0, placed
    after the real ones). N = min(num_anchors, most candidates in any row), at least 1.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    b, L = loss_mask.shape
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:]
    n = max(1, min(num_anchors, int(cand.sum(1).max())))
    gen_dev = generator.device if generator is not None else lm.device
    keys = torch.rand(b, L, generator=generator, device=gen_dev).to(lm.device).masked_fill(~cand, 2.0)
    picked = keys.topk(n, dim=1, largest=False).indices  # [b, n]
    order = torch.where(cand.gather(1, picked), picked, picked + L).sort(dim=1).values
    keep = order < L
    return torch.where(keep, order, 0), keep


@dataclass
class Blocks:
    """N blocks of B slots per sequence. Slot k of the block anchored at a sits at position a+k
    and predicts the token at a+k+1 (DeepSpec: the anchor slot is itself a prediction position)."""

    anchors: torch.Tensor  # [b, N] long
    keep: torch.Tensor  # [b, N] bool
    input_ids: torch.Tensor  # [b, N, B]: [x_a, mask, ..., mask]; dummy blocks all mask
    positions: torch.Tensor  # [b, N, B] a + k
    labels: torch.Tensor  # [b, N, B] x_{a+k+1} (clamped index past the end)
    prev: torch.Tensor  # [b, N, B] teacher-forced previous token: [x_a, labels[..., :-1]]
    valid: torch.Tensor  # [b, N, B] bool: supervised slots (a contiguous prefix per block)


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
    block_size: int, mask_token_id: int,
) -> Blocks:
    """Block inputs, labels and the eval mask of input_ids [b, L], loss_mask [b, L] and blocks at
    anchors [b, N] (keep [b, N] bool): slot k is valid iff a+k+1 < L, loss_mask[a+k+1] and the
    block is kept, cut at the first invalid slot."""
    b, L = input_ids.shape
    n = anchors.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # [b, N, B]
    nxt = (pos + 1).clamp(max=L - 1).view(b, -1)
    labels = input_ids.gather(1, nxt).view(b, n, block_size)
    ok = (pos + 1 < L) & loss_mask.bool().gather(1, nxt).view(b, n, block_size) & keep[..., None]
    valid = ok.int().cummin(dim=-1).values.bool()
    first = torch.where(keep, input_ids.gather(1, anchors), mask_token_id)  # [b, N]
    ids = torch.full_like(labels, mask_token_id)
    ids[..., 0] = first
    prev = torch.cat([input_ids.gather(1, anchors)[..., None], labels[..., :-1]], dim=-1)
    return Blocks(anchors, keep, ids, pos, labels, prev, valid)


def _mask_mod(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int):
    """Visibility of key kv for query q (of sequence b): context kv < anchor (kept blocks only)
    or a slot of q's own block. Dummy blocks still see themselves (no empty softmax rows)."""

    def mask_mod(b, h, q, kv):
        blk = q // block_size
        own = (kv >= ctx_len) & ((kv - ctx_len) // block_size == blk)
        return ((kv < anchors[b, blk]) & keep[b, blk]) | own

    return mask_mod


def training_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int, impl: str = "auto"):
    """Block-sparse mask over [context L | N blocks] of anchors [b, N] (keep [b, N] bool): a dense
    bool [b, 1, N·B, L+N·B] for SDPA
    (``impl="dense"``) or a FlexAttention ``BlockMask`` (``"flex"``); ``"auto"`` = flex on CUDA."""
    if impl not in ("auto", "dense", "flex"):
        raise ValueError(f"impl must be auto, dense or flex, got {impl!r}")
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    mod = _mask_mod(anchors, keep, ctx_len, block_size)
    if impl == "flex" or (impl == "auto" and anchors.is_cuda):
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mod, b, None, q_len, kv_len, device=anchors.device)
    dev = anchors.device
    bi = torch.arange(b, device=dev)[:, None, None, None]
    qi = torch.arange(q_len, device=dev)[None, None, :, None]
    ki = torch.arange(kv_len, device=dev)[None, None, None, :]
    return mod(bi, None, qi, ki)


# --------------------------------------------------------------------------------------
# The backbone
# --------------------------------------------------------------------------------------


class ParallelBackbone(nn.Module):
    """fc + hidden_norm fusion, decoder layers with KV injection, final norm (see module doc)."""

    def __init__(self, cfg: BackboneConfig, num_taps: int):
        super().__init__()
        d = cfg.hidden_size
        if cfg.layer_style not in LAYER_STYLES:
            raise DspecError(f"layer_style must be one of {', '.join(LAYER_STYLES)}, got {cfg.layer_style!r}")
        self.fc = Linear(num_taps * d, d, bias=False)
        self.hidden_norm = _norm(cfg, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _norm(cfg, d)
        self.rotary = Rotary(cfg)
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., n·d] -> H_ctx [..., d]."""
        return self.hidden_norm(self.fc(taps.to(self.dtype)))

    def new_cache(self) -> ContextCache:
        return ContextCache(len(self.layers), self.kv_heads, self.head_dim, self.fc.weight.device, self.dtype)

    def extend_cache(self, cache: ContextCache, taps: torch.Tensor, counts: torch.Tensor, max_count: int) -> None:
        """Append context: taps [N, n·d] of ``counts`` [R] new tokens per row (row order)."""
        rows, pos = cache.slots(counts, taps.shape[0], max_count)
        fused = self.fuse(taps)
        cos, sin = self.rotary(pos, self.dtype)
        cache.write(rows, pos, [cast(DecoderLayer, layer).self_attn.project_kv(fused, cos, sin) for layer in self.layers],
                    counts)

    def extend_cache_grid(self, cache: ContextCache, taps: torch.Tensor, counts: torch.Tensor) -> None:
        """Append context from padded rows: taps [n, W, n·d] of rows [0, n), of which the first
        ``counts[r]`` [n] are new tokens (padding rows: 0). No host reads and no host bookkeeping
        (capturable): the cache must have room for W more slots per row (:meth:`ContextCache.reserve`)
        and its host ``bounds`` are the caller's to keep (:meth:`ContextCache.settle`)."""
        pos = cache.lengths_rows(taps.shape[0])[:, None] + torch.arange(taps.shape[1], device=taps.device)  # [n, W]
        fused = self.fuse(taps)
        cos, sin = self.rotary(pos, self.dtype)
        cache.write_grid(pos, [cast(DecoderLayer, layer).self_attn.project_kv(fused, cos, sin) for layer in self.layers], counts)

    def forward_block(self, embeds: torch.Tensor, positions: torch.Tensor, cache: ContextCache) -> torch.Tensor:
        """One block per row: embeds [n, B, d] at positions [n, B] over the cached context of rows
        [0, n) (n may exceed R: padding rows) -> final-normed hidden states h [n, B, d]. The cache
        is not modified."""
        R, B, _ = embeds.shape
        cos, sin = self.rotary(positions, self.dtype)
        keys, values, ctx = cache.context(R)
        vis = None if ctx is None else torch.cat([ctx, ctx.new_ones(R, B)], dim=1)[:, None, None, :]  # [R, 1, 1, S+B]
        x = embeds.to(self.dtype)
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            x = layer(x, cos, sin, k, v, vis)
        return self.norm(x)

    def forward_train(self, embeds: torch.Tensor, positions: torch.Tensor, taps: torch.Tensor, mask) -> torch.Tensor:
        """All blocks of b sequences: embeds [b, N·B, d] at positions [b, N·B], context
        taps [b, L, n·d] at positions 0..L−1, mask from :func:`training_mask` -> h [b, N·B, d]."""
        b, L = taps.shape[:2]
        fused = self.fuse(taps)
        ccos, csin = self.rotary(torch.arange(L, device=taps.device).expand(b, L), self.dtype)
        cos, sin = self.rotary(positions, self.dtype)
        x = embeds.to(self.dtype)
        for layer in self.layers:
            k, v = cast(DecoderLayer, layer).self_attn.project_kv(fused, ccos, csin)  # [b, L, Hkv, hd]
            x = layer(x, cos, sin, k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.norm(x)
