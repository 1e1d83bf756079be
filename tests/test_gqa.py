"""Grouped-query attention with stacked query heads (the layout SDPA's fused CUDA kernels take
under a mask) equals SDPA's own grouped-query attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspec_cli.nn.gqa import sdpa_stacked, stacked_mask


@pytest.mark.parametrize("q_len,mask_rows", [(1, 1), (5, 1), (5, 5)])  # a plain step, the drafter's block, a verify step
def test_stacked_heads_equal_grouped_attention_with_one_call_of_equal_heads(q_len, mask_rows, monkeypatch):
    gen = torch.Generator().manual_seed(q_len + mask_rows)
    query = torch.randn(3, q_len, 8, 16, generator=gen).transpose(1, 2)  # [B, H, q, d], as models make it
    key, value = torch.randn(3, 2, 11, 16, generator=gen), torch.randn(3, 2, 11, 16, generator=gen)
    mask = torch.rand(3, 1, mask_rows, 11, generator=gen) < 0.6
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True, scale=0.3)
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape, attn_mask, kwargs))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = sdpa_stacked(query, key, value, mask, scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (shape, passed, kwargs), = calls
    assert shape == (3, 2, 4 * q_len, 16) and not kwargs.get("enable_gqa")
    assert passed is mask if mask_rows == 1 else passed.shape == (3, 1, 4 * q_len, 11)


def test_a_mask_is_stacked_once():
    mask = torch.rand(2, 1, 3, 7) < 0.5
    first = stacked_mask(mask, 4)
    assert stacked_mask(mask, 4) is first and stacked_mask(mask.clone(), 4) is not first
    assert torch.equal(first.view(2, 1, 4, 3, 7)[:, :, 2], mask)  # heads of a KV head, each with the mask's rows
