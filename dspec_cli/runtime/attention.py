"""The target's attention: transformers' SDPA, with grouped-query attention over a mask done
without copying the cache.

transformers' ``sdpa`` attention, given a mask (every masked step: a plain step's one query
token as well as a verify step's several), repeats each KV head for its query heads, a copy of
the whole K/V cache per layer and step (recent versions skip the copy for one query token, but
not under ``torch.compile``). ``dspec_sdpa`` instead stacks the query heads that share a KV head
along the query axis and calls SDPA once with as many heads as the cache
(:func:`dspec_cli.nn.gqa.sdpa_stacked`): the same attention over the same keys, for any query
length and any transformers version, with no copy of the cache; the stacked mask is made once
per forward, not per layer. Every other call (no mask, float masks, position biases) goes to
transformers' ``sdpa_attention_forward`` unchanged. :func:`use_for` switches a model loaded
with ``sdpa``.
"""

from __future__ import annotations

import torch

from dspec_cli.nn.gqa import sdpa_stacked

__all__ = ["NAME", "use_for"]

NAME = "dspec_sdpa"


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """query [B, H, q, d], key/value [B, H_kv, S, d], attention_mask [B or 1, 1, q, S] bool or
    None -> (output [B, q, H, d], None), as transformers' attention functions return."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    stack = (
        groups > 1 and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None and key.shape[1] * groups == query.shape[1]
    )  # fmt: skip
    if not stack:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = sdpa_stacked(query, key, value, attention_mask, scale=scaling, dropout=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def attn_implementation(model) -> str | None:
    """The attention implementation a transformers model runs (``"sdpa"``, ``"eager"``, ...).
    transformers has no public getter, so this is the one read of its ``config._attn_implementation``
    (tests/test_private_apis.py fails if an upgrade removes it)."""
    return model.config._attn_implementation


def use_for(model) -> bool:
    """Switch ``model`` from ``sdpa`` to ``dspec_sdpa`` (registered with transformers on first
    use); False, and the model unchanged, where transformers or the model does not take it."""
    if attn_implementation(model) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        model.set_attn_implementation(NAME)
    except (ImportError, AttributeError, ValueError, TypeError):
        return False
    return attn_implementation(model) == NAME
