"""Triton kernels for block verification of chains (optional; needs the `triton` package).

Same contract and arithmetic as :func:`dspec_cli.runtime.verify.block.block` (the rule and why
it is exact are there). Two launches:

1. ``_mass_kernel``, one program per (request, draft position k, vocabulary block): the partial
   residual masses Σ max(ρ_k·p_k − q_k, 0) of one block of V (float32 terms, float64 sums),
   k = 1..ℓ_r − 1, so every row of the vocabulary is read once, in parallel.
2. ``_decide_kernel``, one program per request: the prefix weights ρ_k (float64, from the draft
   tokens' probabilities), the stop probabilities h_k from the summed masses, τ = the last k
   whose coin is below h_k, then one pass over the vocabulary in blocks of BLOCK_V for the final
   token: an exponential race over the residual max(ρ_τ·p − q, 0) (or the bonus row) with a
   running argmax, as the token kernel does.

ρ and the final token match the torch reference bit for bit; the masses Z_k only to float64
rounding (the partial sums run in another order), so a coin would have to fall within ~1e-16
of h_k for a decision to differ. Rows are found as by the other Triton kernels (``cu``: where each
request's drafts end), so padded rows run in place. Like :mod:`dspec_cli.runtime.verify.triton_kernels`, the kernels
run in the Triton interpreter when TRITON_INTERPRET=1 is set before triton is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify.triton import check_device, draft_ends

# Kernel bodies and launches are typed by Triton's compiler, not by pyright.
# pyright: reportAttributeAccessIssue=false, reportOperatorIssue=false, reportCallIssue=false, reportArgumentType=false

MAX_BLOCK_V = 4096



@triton.jit
def _mass_kernel(
    target_ptr,  # [Σ(ℓ+1), V] target probabilities
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] draft probabilities
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end (inclusive prefix sums of ℓ, or r·W + ℓ_r)
    mass_ptr,  # [Σℓ, NB] float64 partial masses (row of draft k, block b)
    vocab,
    num_blocks,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    k = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    if (k >= 1) & (k < n):  # Z_0 decides nothing; Z_k of k < ℓ only
        p_start = d_start + r
        rho = tl.full([], 1.0, tl.float64)
        for j in range(k):  # ρ_k from the drafts before k
            x = tl.load(draft_tok_ptr + d_start + j)
            p_x = tl.load(target_ptr + (p_start + j) * vocab + x).to(tl.float32)
            q_x = tl.load(draft_prob_ptr + (d_start + j) * vocab + x).to(tl.float32)
            ratio = tl.where(q_x > 0, p_x.to(tl.float64) / tl.where(q_x > 0, q_x.to(tl.float64), 1.0),
                             tl.where(p_x > 0, float("inf"), 0.0))
            rho = tl.where(rho > 0, tl.minimum(rho * ratio, 1.0), 0.0)
        offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
        m = offs < vocab
        p = tl.load(target_ptr + (p_start + k) * vocab + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(draft_prob_ptr + (d_start + k) * vocab + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.maximum(rho.to(tl.float32) * p - q, 0.0)
        tl.store(mass_ptr + (d_start + k) * num_blocks + b, tl.sum(w.to(tl.float64), 0))


@triton.jit(do_not_specialize=["out_width"])
def _decide_kernel(
    target_ptr,  # [Σ(ℓ+1), V] target probabilities
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] draft probabilities
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end
    mass_ptr,  # [Σℓ, NB] float64 partial masses from _mass_kernel
    uniform_ptr,  # [Σℓ] float64 coins
    noise_ptr,  # [R, V] float32 Exp(1)
    out_tok_ptr,  # [R, out_width] int64, pre-filled with -1
    out_acc_ptr,  # [R] int64
    vocab,
    num_blocks,
    out_width,
    BLOCK_V: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    p_start = d_start + r
    out_row = out_tok_ptr + r.to(tl.int64) * out_width

    rho = tl.full([], 1.0, tl.float64)  # ρ_k, k = drafts processed so far
    rho_acc = tl.full([], 1.0, tl.float64)  # ρ_τ
    accepted = tl.full([], 0, tl.int64)  # τ
    nb = tl.arange(0, BLOCK_NB)
    for k in range(n):
        x = tl.load(draft_tok_ptr + d_start + k)
        p_x = tl.load(target_ptr + (p_start + k) * vocab + x).to(tl.float32)
        q_x = tl.load(draft_prob_ptr + (d_start + k) * vocab + x).to(tl.float32)
        ratio = tl.where(q_x > 0, p_x.to(tl.float64) / tl.where(q_x > 0, q_x.to(tl.float64), 1.0),
                         tl.where(p_x > 0, float("inf"), 0.0))
        rho = tl.where(rho > 0, tl.minimum(rho * ratio, 1.0), 0.0)  # ρ_{k+1}
        blocks = tl.where(k + 1 < n, num_blocks, 0)  # Z_{k+1} (none after the last draft)
        z = tl.sum(tl.load(mass_ptr + (d_start + k + 1) * num_blocks + nb, mask=nb < blocks, other=0.0), 0)
        denom = z + 1.0 - rho
        h = tl.where(k + 1 < n, tl.where(denom > 0, z / tl.where(denom > 0, denom, 1.0), 1.0), rho)
        hit = tl.load(uniform_ptr + d_start + k) < h  # τ = the last k whose coin is below h_k
        accepted = tl.where(hit, k + 1, accepted)
        rho_acc = tl.where(hit, rho, rho_acc)
    for j in range(n):
        tl.store(out_row + j, tl.load(draft_tok_ptr + d_start + j), mask=j < accepted)

    rejected = accepted < n
    q_len = tl.where(rejected, vocab, 0)  # q row length to read (0: bonus, no residual)
    scale = tl.where(rejected, rho_acc, 1.0).to(tl.float32)
    fin_row = (p_start + accepted) * vocab
    q_row = (d_start + accepted) * vocab
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
        q = tl.load(draft_prob_ptr + q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        res = tl.maximum(scale * p - q, 0.0)
        e = tl.load(noise_ptr + noise_row + offs, mask=m, other=1.0)
        s_r = tl.where(m, tl.div_rn(res, e), -1.0)
        s_p = tl.where(m, tl.div_rn(p, e), -1.0)
        b_r, i_r = tl.max(s_r, 0, return_indices=True, return_indices_tie_break_left=True)
        b_p, i_p = tl.max(s_p, 0, return_indices=True, return_indices_tie_break_left=True)
        top_res = tl.max(res, 0)
        idx_r = tl.where(b_r > best_r, v0 + i_r, idx_r)
        best_r = tl.maximum(best_r, b_r)
        idx_p = tl.where(b_p > best_p, v0 + i_p, idx_p)
        best_p = tl.maximum(best_p, b_p)
        any_r = tl.maximum(any_r, (top_res > 0).to(tl.int32))
    token = tl.where(any_r > 0, idx_r, idx_p)
    tl.store(out_row + accepted, token.to(tl.int64))
    tl.store(out_acc_ptr + r, accepted.to(tl.int64))


def block(
    target_probs: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor,  # [Σℓ_r, V]
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor,  # [R, V] float32 Exp(1)
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64: inclusive prefix sums of ℓ, or arange(R)·W + ℓ for padded rows
    block_v: int | None = None,
) -> VerifyResult:
    """Triton block verification; same contract as :func:`dspec_cli.runtime.verify.block.block`
    (the final token by the exponential race only). ``cu`` locates the rows as in
    :func:`dspec_cli.runtime.verify.triton.chain` (padded rows: :func:`~dspec_cli.runtime.verify.triton.grid_ends`)."""
    check_device(target_probs.device)
    R, vocab = num_draft.numel(), target_probs.shape[1]
    dev = target_probs.device
    tokens = torch.full((R, width + 1), -1, dtype=torch.long, device=dev)
    accepted = torch.zeros(R, dtype=torch.long, device=dev)
    if R == 0:
        return VerifyResult(accepted, tokens, accepted + 1)
    block_size = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))
    num_blocks = triton.cdiv(vocab, block_size)
    target, q = target_probs.contiguous(), draft_probs.contiguous()
    drafts, ends = draft_tokens.contiguous(), draft_ends(num_draft, cu)
    mass = torch.zeros(max(total, 1), num_blocks, dtype=torch.float64, device=dev)
    if width > 1:
        _mass_kernel[(R, width, num_blocks)](
            target, drafts, q, num_draft, ends, mass, vocab, num_blocks, BLOCK_V=block_size,
            enable_fp_fusion=False,  # no FMA contraction: the reference's arithmetic
        )  # fmt: skip
    _decide_kernel[(R,)](
        target, drafts, q, num_draft, ends, mass, uniforms.contiguous(), noise.contiguous(), tokens, accepted, vocab,
        num_blocks, width + 1, BLOCK_V=block_size, BLOCK_NB=triton.next_power_of_2(num_blocks),
        enable_fp_fusion=False,
    )  # fmt: skip
    return VerifyResult(accepted, tokens, accepted + 1)
