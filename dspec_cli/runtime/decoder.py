"""The target's forward on a CPU for the Llama family (Llama, Mistral without sliding windows,
Qwen2, Qwen3): few operations per step, and the same numbers for a token whether it is scored
alone or among the ℓ + 1 tokens of a verify.

transformers' forward dispatches about six hundred tensor operations for one decoding step of a
six-layer model (module calls, its mask and cache machinery, RoPE per layer, hooks), each a few
µs of host time on a CPU, where the step's arithmetic takes less than that. :class:`LeanDecoder`
runs the same model in the style of gpt-fast: query/key/value and gate/up weights fused once
(multiplied through oneDNN-packed copies, :class:`~dspec_cli.nn.linear.PackedWeight`), Qwen3's
query and key norms and RoPE applied to all heads at once, RoPE's cos/sin and the attention bias
built once per forward rather than per layer, the hidden taps collected in the loop (no hooks):
about a hundred operations per layer fewer, and far less Python. It reads and writes the target's
:class:`~dspec_cli.runtime.kv_cache.SlotCache` through the cache's own ``update``, so both forwards
share one KV cache layout.

**Batch invariance.** With greedy decoding a drafter's output equals plain decoding's only if a
position's logits are the same, bit for bit, in a one-token step and in a verify of ℓ + 1 tokens.
oneDNN's matmuls give each row the same result whatever the number of rows (checked for every
shape here), but PyTorch's fused CPU attention does not (its second matmul takes another path
for one query row, and its softmax sums a window's tail apart from the rest). So attention is
written out: scores by one matmul, PyTorch's softmax over the slots (float32, as transformers'
eager attention: its CPU kernel reduces a row in vectors of 16 floats from the first slot into
one accumulator, so masked slots, exact zeros, change no sum whatever the window's length),
probabilities times values by another matmul; windows are multiples of :data:`WINDOW_MULTIPLE`
slots, so no row has a vector tail. Scores are rounded to the model's dtype as transformers'
eager attention rounds them. ``tests/test_batch_invariance.py`` checks greedy identity for the shipped drafters.

Each forward says which attention it runs (``invariant``; the engine decides, per run:
``GenerationConfig.batch_invariance``): this invariant one, or PyTorch's fused attention
(:func:`attend_fused`, one ``scaled_dot_product_attention`` call per layer over exact windows),
faster but with logits that depend on how many tokens the forward scores. Either is exact
sampling from the logits its forward computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspec_cli.nn.gqa import sdpa_stacked
from dspec_cli.nn.linear import PackedWeight

__all__ = ["FAMILIES", "WINDOW_MULTIPLE", "LeanDecoder", "attend", "attend_fused", "rms_norm"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # model_type of the configs this forward runs
WINDOW_MULTIPLE = 16  # invariant attention's windows are multiples of this (one AVX-512 vector of float32)
_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] / RMS(x) computed in float32 and rounded to x's dtype; times the weight (in x's
    dtype) this is transformers' RMSNorm, bit for bit."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _Layer(nn.Module):
    """One decoder layer's tensors, fused where the forward multiplies them together. A module,
    so that ``torch.compile`` with freezing (graphs.py, "compile" on a CPU) packs the fused
    copies as it packs parameters."""

    qkv: torch.Tensor  # buffers (registered below), typed for the checker
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None

    def __init__(self, layer, heads: int, kv_heads: int) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.register_buffer("qkv", torch.cat([p.weight for p in projections]), persistent=False)  # [(H + 2·H_kv)·D, d]
        biases = [p.bias for p in projections]
        self.register_buffer("qkv_bias", None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else p.weight.new_zeros(p.weight.shape[0]) for b, p in zip(biases, projections, strict=True)]),
            persistent=False)
        qk_norm = None  # [H + H_kv, D]: Qwen3's per-head norm weights, query heads then key heads
        if hasattr(attn, "q_norm"):
            dim = attn.q_norm.weight.shape[0]
            qk_norm = torch.cat([attn.q_norm.weight.expand(heads, dim), attn.k_norm.weight.expand(kv_heads, dim)])
        self.register_buffer("qk_norm", qk_norm, persistent=False)
        self.o, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.register_buffer("gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), persistent=False)  # [2·I, d]
        self.register_buffer("gate_up_bias", None if mlp.gate_proj.bias is None else torch.cat(
            [mlp.gate_proj.bias, mlp.up_proj.bias]), persistent=False)
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        self.packs = {name: PackedWeight() for name in ("qkv", "o", "gate_up", "down")}

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] times the fused weight ``name`` (qkv, o, gate_up, down) -> [..., out]."""
        return self.packs[name].linear(x, getattr(self, name), getattr(self, f"{name}_bias"))


class LeanDecoder:
    """The forward of a supported decoder (:meth:`unsupported` says why another is not) over a
    :class:`~dspec_cli.runtime.kv_cache.SlotCache`; see the module docstring."""

    def __init__(self, model) -> None:
        self.model = model
        config = model.config.get_text_config()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        decoder = model.get_decoder()
        attn = decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.eps = config.rms_norm_eps
        self._head = PackedWeight()
        self._key: tuple | None = None
        self.sync()

    @staticmethod
    def unsupported(model) -> str | None:
        """Why :class:`LeanDecoder` cannot run ``model`` on its device; None when it can."""
        config = model.config.get_text_config()
        param = next(model.parameters())
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        checks = (
            (config.model_type in FAMILIES, f"model type {config.model_type!r} (runs {', '.join(FAMILIES)})"),
            (param.device.type == "cpu", f"device {param.device.type}"),
            (param.dtype in _DTYPES, f"dtype {param.dtype}"),
            (getattr(config, "hidden_act", "silu") == "silu", f"activation {getattr(config, 'hidden_act', None)}"),
            (not getattr(config, "sliding_window", None) or not getattr(config, "use_sliding_window", True),
             "sliding-window attention"),
            ("dynamic" not in rope and rope != "longrope", f"RoPE {rope!r} (frequencies change with the length)"),
            (torch.backends.mkldnn.is_available() or param.dtype == torch.float32, "no oneDNN"),
        )
        return next((why for ok, why in checks if not ok), None)

    def sync(self) -> None:
        """Re-read the model's weights if they changed since the last call (loads, fine-tuning):
        fused copies are rebuilt. Cheap when nothing changed; called before each prefill."""
        params = list(self.model.parameters())
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key == self._key:
            return
        decoder = self.model.get_decoder()
        self.layers = [_Layer(layer, self.heads, self.kv_heads) for layer in decoder.layers]
        self.embed = self.model.get_input_embeddings().weight  # [V, d]
        self.norm = decoder.norm.weight
        self.lm_head = self.model.get_output_embeddings().weight  # [V, d] (tied: the embedding)
        rotary = decoder.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [D/2]
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._key = key

    # -- the forward -----------------------------------------------------------------------------

    def forward(
        self,
        cache,
        ids: torch.Tensor,  # [n, q] token ids
        pos: torch.Tensor,  # [n, q] positions (RoPE)
        window: int,
        mask: torch.Tensor | None,  # [n, 1, q, window] bool (True = attend); None: causal, ending at the window's end
        layer_ids: Sequence[int],
        last_only: bool,
        invariant: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``ids`` after the rows' cached tokens (the cache's ``io`` says where they
        are written and which ``window`` of slots attention reads): (logits [n, q or 1, V] in the
        model's dtype, taps [n, q, len(layer_ids)·d], the raw outputs of ``layer_ids``, -1 = the
        embedding). ``invariant``: batch-invariant attention (:func:`attend`, ``window`` a multiple
        of :data:`WINDOW_MULTIPLE`), else PyTorch's fused attention (:func:`attend_fused`)."""
        n, q = ids.shape
        x = F.embedding(ids, self.embed)  # [n, q, d]
        tapped = {-1: x} if -1 in layer_ids else {}
        cos, sin = self._rope(pos, x.dtype)
        mask = self._mask(mask, n, q, window)  # [n, 1, q, S] bool
        attention = (attend, torch.where(mask, 0.0, -math.inf)[:, :, None]) if invariant else (attend_fused, mask)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, i, cache, rms_norm(x, self.eps) * layer.norm1, cos, sin, *attention)
            x = x + self._mlp(layer, rms_norm(x, self.eps) * layer.norm2)
            if i in layer_ids:
                tapped[i] = x
        if last_only:
            x = x[:, -1:]
        logits = self._head.linear(rms_norm(x, self.eps) * self.norm, self.lm_head)
        taps = torch.cat([tapped[int(i)] for i in layer_ids], dim=-1) if layer_ids else ids.new_zeros(n, q, 0, dtype=x.dtype)
        return logits, taps

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [n, q, 1, D] and sin with rotate-half's sign folded in ([-sin, sin] halves), in
        ``dtype``, as transformers computes them (float, then rounded)."""
        freqs = pos[..., None].float() * self.inv_freq  # [n, q, D/2]
        cos = (freqs.cos() * self.rope_scaling).to(dtype)
        sin = (freqs.sin() * self.rope_scaling).to(dtype)
        return torch.cat([cos, cos], -1)[:, :, None], torch.cat([-sin, sin], -1)[:, :, None]

    def _mask(self, mask: torch.Tensor | None, n: int, q: int, window: int) -> torch.Tensor:
        """``mask`` [n, 1, q, window] bool; None: causal with the q new tokens at the window's last
        slots."""
        if mask is not None:
            return mask
        col = torch.arange(window, device=self.embed.device)
        row = torch.arange(window - q, window, device=self.embed.device)
        return (col[None, :] <= row[:, None])[None, None].expand(n, 1, q, window)

    def _attention(self, layer: _Layer, idx: int, cache, h, cos, sin, attend_fn, visible) -> torch.Tensor:
        """Self-attention of h [n, q, d] (normed) -> [n, q, d] by ``attend_fn`` (:func:`attend` with
        its bias or :func:`attend_fused` with its mask: ``visible``); writes the new keys and values."""
        n, q, _ = h.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        qkv = layer.linear("qkv", h).view(n, q, H + 2 * Hkv, D)
        qk = qkv[:, :, : H + Hkv]  # query heads, then key heads
        if layer.qk_norm is not None:
            qk = rms_norm(qk, self.eps) * layer.qk_norm
        qk = qk * cos + qk.roll(D // 2, -1) * sin  # RoPE
        k_win, v_win = cache.update(qk[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv :].transpose(1, 2), idx)
        out = attend_fn(qk[:, :, :H], k_win, v_win, visible, self.scale)  # [n, q, H·D]
        return layer.linear("o", out)

    @staticmethod
    def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.linear("gate_up", h).chunk(2, dim=-1)
        return layer.linear("down", F.silu(gate) * up)


def attend(
    queries: torch.Tensor,  # [n, q, H, D]
    keys: torch.Tensor,  # [n, H_kv, S, D]
    values: torch.Tensor,  # [n, H_kv, S, D]
    bias: torch.Tensor,  # [n, 1, 1, q, S] float, 0 or -inf
    scale: float,
) -> torch.Tensor:
    """Batch-invariant attention (module docstring) -> [n, q, H·D]. The query heads that share a
    key/value head are stacked along the query axis: no copy of the cache per head."""
    n, q, H, D = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    g = H // Hkv
    stacked = queries.transpose(1, 2).reshape(n * Hkv, g * q, D)
    scores = torch.bmm(stacked, keys.view(n * Hkv, S, D).transpose(1, 2))  # [n·H_kv, g·q, S]
    scores = torch.add(bias, scores.view(n, Hkv, g, q, S), alpha=scale)  # float
    weights = torch.softmax(scores, -1).to(values.dtype)  # float32, as transformers' eager attention
    out = torch.bmm(weights.view(n * Hkv, g * q, S), values.view(n * Hkv, S, D))  # [n·H_kv, g·q, D]
    return out.view(n, H, q, D).transpose(1, 2).reshape(n, q, H * D)


def attend_fused(
    queries: torch.Tensor,  # [n, q, H, D]
    keys: torch.Tensor,  # [n, H_kv, S, D]
    values: torch.Tensor,  # [n, H_kv, S, D]
    mask: torch.Tensor,  # [n, 1, q, S] bool (True = attend)
    scale: float,
) -> torch.Tensor:
    """PyTorch's fused attention (one ``scaled_dot_product_attention`` call, the query heads that
    share a key/value head stacked: :func:`~dspec_cli.nn.gqa.sdpa_stacked`) -> [n, q, H·D]. Faster
    than :func:`attend`, and not batch-invariant (module docstring)."""
    n, q, H, D = queries.shape
    out = sdpa_stacked(queries.transpose(1, 2), keys, values, mask, scale=scale)  # [n, H, q, D]
    return out.transpose(1, 2).reshape(n, q, H * D)
