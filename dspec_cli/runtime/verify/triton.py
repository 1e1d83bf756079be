"""Triton kernels for chain and greedy verification (optional; needs the `triton` package).

One program per request over the flattened ragged layout: the exclusive prefix sums of ℓ_r are
computed once on the device and each program reads its span from them. The final token of a
request comes from one pass over the vocabulary in blocks of BLOCK_V, keeping two running
exponential-race argmaxes (residual and target) so no renormalisation is needed. Arithmetic
mirrors :mod:`dspec_cli.runtime.verify.reference` bit for bit (float64 acceptance ratio, IEEE
round-to-nearest division for the race, first index on ties), so both backends give identical
tokens for the same explicit randomness.

Kernels are jitted lazily, once per TRITON_INTERPRET setting (Triton reads it when a function
is jitted): CUDA tensors use compiled kernels; CPU tensors need TRITON_INTERPRET=1 (the Triton
interpreter, for tests), which may be set at any time before the call.
"""

from __future__ import annotations

import torch
import triton
import triton.knobs
import triton.language as tl

from dspec_cli.core.ragged import prefix_sums
from dspec_cli.core.types import VerifyResult

MAX_BLOCK_V = 4096

# (value, index) argmax combine with the first index on ties: the one behind tl.max(...,
# return_indices=True). Used through the builtin tl.reduce so the kernels also run in the
# interpreter when TRITON_INTERPRET is set after `import triton` (tl.max itself is a jitted
# function, bound to the mode in force at import); the interpreter recognises this combine.
_ARGMAX = tl.standard._argmax_combine_tie_break_left


def _chain_kernel(
    target_ptr,  # [Σ(ℓ+1), V] target probabilities
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] (unused when HAS_DRAFT_PROBS is False)
    cu_ptr,  # [R+1] int64, exclusive prefix sums of ℓ
    uniform_ptr,  # [Σℓ] float64 acceptance coins
    noise_ptr,  # [R, V] float32 Exp(1)
    out_tok_ptr,  # [R, out_width] int64, pre-filled with -1
    out_acc_ptr,  # [R] int64
    vocab,
    out_width,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    d_start = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - d_start
    p_start = d_start + r
    out_row = out_tok_ptr + r.to(tl.int64) * out_width

    accepted = 0
    for k in range(0, n):
        if accepted == k:  # still accepting
            x = tl.load(draft_tok_ptr + d_start + k)
            p_x = tl.load(target_ptr + (p_start + k) * vocab + x).to(tl.float32)
            p64 = p_x.to(tl.float64)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(draft_prob_ptr + (d_start + k) * vocab + x).to(tl.float32)
                ratio = p64 / tl.where(q_x > 0, q_x.to(tl.float64), 1.0)
                prob = tl.where(q_x > 0, tl.minimum(ratio, 1.0), tl.where(p_x > 0, 1.0, 0.0))
            else:
                prob = tl.minimum(p64, 1.0)
            if tl.load(uniform_ptr + d_start + k) < prob:
                tl.store(out_row + k, x)
                accepted += 1

    rejected = accepted < n
    q_len = tl.where(rejected, vocab, 0)  # q row length to read (0: bonus, no residual)
    fin_row = (p_start + accepted) * vocab
    q_row = (d_start + accepted) * vocab
    x_rej = tl.load(draft_tok_ptr + d_start + accepted, mask=rejected, other=-1)
    noise_row = r.to(tl.int64) * vocab
    best_r = -1.0
    idx_r = 0
    best_p = -1.0
    idx_p = 0
    any_r = 0
    lane = tl.arange(0, BLOCK_V)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + lane
        m = offs < vocab
        p = tl.load(target_ptr + fin_row + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_prob_ptr + q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        else:
            q = tl.where(offs == x_rej, 1.0, 0.0)
        res = tl.maximum(p - q, 0.0)
        e = tl.load(noise_ptr + noise_row + offs, mask=m, other=1.0)
        s_r = tl.where(m, tl.div_rn(res, e), -1.0)
        s_p = tl.where(m, tl.div_rn(p, e), -1.0)
        b_r, i_r = tl.reduce((s_r, lane), 0, _ARGMAX)
        b_p, i_p = tl.reduce((s_p, lane), 0, _ARGMAX)
        top_res, _ = tl.reduce((res, lane), 0, _ARGMAX)
        idx_r = tl.where(b_r > best_r, v0 + i_r, idx_r)
        best_r = tl.maximum(best_r, b_r)
        idx_p = tl.where(b_p > best_p, v0 + i_p, idx_p)
        best_p = tl.maximum(best_p, b_p)
        any_r = tl.maximum(any_r, (top_res > 0).to(tl.int32))
    token = tl.where(any_r > 0, idx_r, idx_p)
    tl.store(out_row + accepted, token.to(tl.int64))
    tl.store(out_acc_ptr + r, accepted.to(tl.int64))  # pyright: ignore[reportAttributeAccessIssue]  # Triton DSL: `accepted` is a tensor inside the kernel


def _greedy_kernel(
    logits_ptr,  # [Σ(ℓ+1), V] target logits
    draft_tok_ptr,  # [Σℓ] int64
    cu_ptr,  # [R+1] int64
    out_tok_ptr,  # [R, out_width] int64, pre-filled with -1
    out_acc_ptr,  # [R] int64
    vocab,
    out_width,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    d_start = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - d_start
    p_start = d_start + r
    out_row = out_tok_ptr + r.to(tl.int64) * out_width

    lane = tl.arange(0, BLOCK_V)
    accepted = 0
    for k in range(0, n + 1):
        if accepted == k:  # rows after the first mismatch are never read
            row = (p_start + k) * vocab
            best = -float("inf")
            idx = 0
            for v0 in range(0, vocab, BLOCK_V):
                offs = v0 + lane
                z = tl.load(logits_ptr + row + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
                b, i = tl.reduce((z, lane), 0, _ARGMAX)
                idx = tl.where(b > best, v0 + i, idx)
                best = tl.maximum(best, b)
            x = tl.load(draft_tok_ptr + d_start + k, mask=k < n, other=-1)
            if x == idx:
                tl.store(out_row + k, x)
                accepted += 1
            else:
                tl.store(out_row + k, idx.to(tl.int64))  # pyright: ignore[reportAttributeAccessIssue]  # Triton DSL: `idx` is a tensor inside the kernel
    tl.store(out_acc_ptr + r, accepted.to(tl.int64))  # pyright: ignore[reportAttributeAccessIssue]  # Triton DSL: `accepted` is a tensor inside the kernel


_JIT: dict[bool, tuple] = {}


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set (kernels then run in the Triton interpreter)."""
    return bool(triton.knobs.runtime.interpret)


def _kernels() -> tuple:
    mode = interpreting()
    if mode not in _JIT:  # triton.jit reads TRITON_INTERPRET when it wraps the function
        _JIT[mode] = (
            triton.jit(do_not_specialize=["out_width"])(_chain_kernel),
            triton.jit(do_not_specialize=["out_width"])(_greedy_kernel),
        )
    return _JIT[mode]


def check_device(device: torch.device) -> None:
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend: 'triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "(the Triton interpreter) or use backend='torch'"
        )


def _block(vocab: int, block_v: int | None) -> int:
    return block_v or min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))


def _outputs(R: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((R, width + 1), -1, dtype=torch.long, device=device)
    return tokens, torch.zeros(R, dtype=torch.long, device=device)


def chain(
    target_probs: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor | None,  # [Σℓ_r, V] or None
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor,  # [R, V] float32
    total: int,
    width: int,
    *,
    block_v: int | None = None,
) -> VerifyResult:
    """Triton chain rejection sampling; same contract as :func:`reference.chain`."""
    check_device(target_probs.device)
    R, vocab = num_draft.numel(), target_probs.shape[1]
    tokens, accepted = _outputs(R, width, target_probs.device)
    if R:
        target = target_probs.contiguous()
        chain_kernel, _ = _kernels()
        chain_kernel[(R,)](
            target,
            draft_tokens.contiguous(),
            target if draft_probs is None else draft_probs.contiguous(),
            prefix_sums(num_draft),
            uniforms.contiguous(),
            noise.contiguous(),
            tokens,
            accepted,
            vocab,
            width + 1,
            HAS_DRAFT_PROBS=draft_probs is not None,
            BLOCK_V=_block(vocab, block_v),
            enable_fp_fusion=False,  # no FMA contraction: bit-identical to the reference
        )
    return VerifyResult(accepted, tokens, accepted + 1)


def greedy(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    num_draft: torch.Tensor,  # [R] long
    total: int,
    width: int,
    *,
    block_v: int | None = None,
) -> VerifyResult:
    """Triton greedy verification; same contract as :func:`reference.greedy`."""
    check_device(target_logits.device)
    R, vocab = num_draft.numel(), target_logits.shape[1]
    tokens, accepted = _outputs(R, width, target_logits.device)
    if R:
        _, greedy_kernel = _kernels()
        greedy_kernel[(R,)](
            target_logits.contiguous(),
            draft_tokens.contiguous(),
            prefix_sums(num_draft),
            tokens,
            accepted,
            vocab,
            width + 1,
            BLOCK_V=_block(vocab, block_v),
            enable_fp_fusion=False,
        )
    return VerifyResult(accepted, tokens, accepted + 1)
