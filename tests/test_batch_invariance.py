"""Batch-invariant verification on a CPU (runtime/decoder.py): in bfloat16 a token's logits in a
verify of ℓ + 1 tokens equal a one-token step's bit for bit, at contexts whose windows cross
the vector width and torch's 512-slot attention blocks; with PyTorch's fused attention in
place of the decoder's (the variant that must fail) they do not. The end-to-end consequence,
greedy output identical with every drafter, is tested in test_embedded_target.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspec_cli.core.hardware import cpu_native_half
from dspec_cli.runtime import decoder
from dspec_cli.runtime.target import Target

pytestmark = pytest.mark.skipif(not cpu_native_half(torch.bfloat16),
                                reason="bit-level invariance is checked where the CPU multiplies bfloat16 natively")

CONTEXTS = (5, 11, 250, 505, 509, 700)  # windows below, across and past a 16-slot vector and 512-slot block
WIDTH = 8  # tokens per verify: an anchor and γ = 7 drafts


@pytest.fixture(scope="module")
def target() -> Target:
    target = Target.load(None, dtype="bfloat16")
    assert target.lean, "the embedded target (Qwen3) runs dspec's own forward on a CPU"
    return target


def _same_logits(target: Target, context: int, seed: int) -> bool:
    """Whether WIDTH one-token steps after ``context`` random tokens give the logits, bit for
    bit, of one verify of the same WIDTH tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(target.vocab_size, (context + WIDTH,), generator=gen)
    batch = target.new_batch(rows=1, slots=context + 2 * WIDTH + 32)
    target.prefill(batch, [tokens[:context].tolist()])
    new = tokens[None, context:]
    verify, _ = target.score(batch, new, None, batch.window(WIDTH))  # [1, WIDTH, V]; commits nothing
    steps = []
    for j in range(WIDTH):
        logits, _ = target.score(batch, new[:, j : j + 1], None, batch.window(1))
        steps.append(logits[:, 0])
        target.keep(batch, torch.ones(1, dtype=torch.long))
        batch.settle([context + j + 1])
    return torch.equal(torch.stack(steps, dim=1), verify)


def test_verify_rows_equal_one_token_steps(target):
    assert all(_same_logits(target, context, seed) for seed, context in enumerate(CONTEXTS))


def _fused_attention(queries, keys, values, bias, scale):
    """PyTorch's fused CPU attention over the same inputs as decoder.attend."""
    n, q, H, D = queries.shape
    mask = bias[:, :, 0] == 0  # [n, 1, q, S]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(n, q, H * D)


def test_fused_attention_is_not_invariant(target, monkeypatch):
    monkeypatch.setattr(decoder, "attend", _fused_attention)
    assert not all(_same_logits(target, context, seed) for seed, context in enumerate(CONTEXTS))
