"""Triton kernels for block verification of chains (optional; needs the `triton` package).

Same contract and arithmetic as :func:`dspec_cli.runtime.verify.block.block` (the rule and why
it is exact are there). Launches, every vocabulary pass split across (row, block) programs:

1. ``_mass_kernel``, one program per (request, draft position k, vocabulary block): the partial
   residual masses Σ max(ρ_k·p_k − q_k, 0) of one block of V (float32 terms, float64 sums),
   k = 1..ℓ_r − 1, so every row of the vocabulary is read once, in parallel.
2. ``_decide_kernel``, one program per request: the prefix weights ρ_k (float64, from the draft
   tokens' probabilities), the stop probabilities h_k from the summed masses, and τ = the last k
   whose coin is below h_k; it stores τ and the residual's weight ρ_τ (1 for the bonus row).
3. the chain kernels' race (:func:`dspec_cli.runtime.verify.triton._race`), one program per
   (request, block) and one per request: the final token by an exponential race over the
   residual max(ρ_τ·p − q, 0) (or the bonus row), with the counter noise computed in the kernel
   when the noise is given by its keys.

From logits (:func:`block_logits`) the target probabilities are never written: two more launches
reduce each row's softmax statistics and every kernel computes exp(z / T − m) / s where it reads
p, as the chain kernels do (tokens equal the reference's on ``logits_to_probs`` except where two
candidates are within rounding).

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

from dspec_cli.core.sampling import CounterNoise
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import triton_kernels as K
from dspec_cli.runtime.verify.triton import (
    _race,
    _rows_2d,
    _run,
    check_device,
    draft_ends,
    row_partials,
)

# Kernel bodies and launches are typed by Triton's compiler, not by pyright.
# pyright: reportAttributeAccessIssue=false, reportOperatorIssue=false, reportCallIssue=false, reportArgumentType=false

MAX_BLOCK_V = 4096
STATS_ROWS = 16  # rows per program combining softmax partials


@triton.jit
def _draft_ratio(target_ptr, t_stride, draft_tok_ptr, draft_prob_ptr, q_stride, stat_max_ptr, stat_sum_ptr,
                 temperature, d_start, p_start, j, FROM_LOGITS: tl.constexpr):
    """p(x_j) / q(x_j) of draft j in float64 (q(x_j) = 0: +inf if p(x_j) > 0, else 0)."""
    x = tl.load(draft_tok_ptr + d_start + j)
    row = p_start + j
    if FROM_LOGITS:
        m, s = tl.load(stat_max_ptr + row), tl.load(stat_sum_ptr + row)
    else:
        m, s = 0.0, 1.0
    p_x = K.target_probs(target_ptr, t_stride, row, x, x >= 0, m, s, temperature, FROM_LOGITS)
    q_x = tl.load(draft_prob_ptr + (d_start + j).to(tl.int64) * q_stride + x).to(tl.float32)
    return tl.where(q_x > 0, p_x.to(tl.float64) / tl.where(q_x > 0, q_x.to(tl.float64), 1.0),
                    tl.where(p_x > 0, float("inf"), 0.0))


@triton.jit
def _mass_kernel(
    target_ptr,  # [Σ(ℓ+1), V] target probabilities, or logits with FROM_LOGITS (row stride t_stride)
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] draft probabilities (row stride q_stride)
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end (inclusive prefix sums of ℓ, or r·W + ℓ_r)
    stat_max_ptr,  # [Σ(ℓ+1)] float32 softmax statistics of the target rows (FROM_LOGITS only)
    stat_sum_ptr,
    mass_ptr,  # [Σℓ, NB] float64 partial masses (row of draft k, block b)
    t_stride,
    q_stride,
    vocab,
    num_blocks,
    temperature,
    FROM_LOGITS: tl.constexpr,
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
            ratio = _draft_ratio(target_ptr, t_stride, draft_tok_ptr, draft_prob_ptr, q_stride, stat_max_ptr,
                                 stat_sum_ptr, temperature, d_start, p_start, j, FROM_LOGITS)
            rho = tl.where(rho > 0, tl.minimum(rho * ratio, 1.0), 0.0)
        offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
        m = offs < vocab
        row = p_start + k
        if FROM_LOGITS:
            row_max, row_sum = tl.load(stat_max_ptr + row), tl.load(stat_sum_ptr + row)
        else:
            row_max, row_sum = 0.0, 1.0
        p = K.target_probs(target_ptr, t_stride, row, offs, m, row_max, row_sum, temperature, FROM_LOGITS)
        q = tl.load(draft_prob_ptr + (d_start + k).to(tl.int64) * q_stride + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.maximum(rho.to(tl.float32) * p - q, 0.0)
        tl.store(mass_ptr + (d_start + k) * num_blocks + b, tl.sum(w.to(tl.float64), 0))


@triton.jit
def _decide_kernel(
    target_ptr,  # [Σ(ℓ+1), V] target probabilities, or logits with FROM_LOGITS
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] draft probabilities
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end
    stat_max_ptr,  # [Σ(ℓ+1)] float32 (FROM_LOGITS only)
    stat_sum_ptr,
    mass_ptr,  # [Σℓ, NB] float64 partial masses from _mass_kernel
    uniform_ptr,  # [Σℓ] float64 coins
    out_acc_ptr,  # [R] int64: τ
    out_scale_ptr,  # [R] float32: ρ_τ after a rejection, 1 for the bonus row
    fin_max_ptr,  # [R] float32 (FROM_LOGITS only): statistics of the final token's row
    fin_sum_ptr,
    t_stride,
    q_stride,
    num_blocks,
    temperature,
    FROM_LOGITS: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    p_start = d_start + r
    rho = tl.full([], 1.0, tl.float64)  # ρ_k, k = drafts processed so far
    rho_acc = tl.full([], 1.0, tl.float64)  # ρ_τ
    accepted = tl.full([], 0, tl.int64)  # τ
    nb = tl.arange(0, BLOCK_NB)
    for k in range(n):
        ratio = _draft_ratio(target_ptr, t_stride, draft_tok_ptr, draft_prob_ptr, q_stride, stat_max_ptr, stat_sum_ptr,
                             temperature, d_start, p_start, k, FROM_LOGITS)
        rho = tl.where(rho > 0, tl.minimum(rho * ratio, 1.0), 0.0)  # ρ_{k+1}
        blocks = tl.where(k + 1 < n, num_blocks, 0)  # Z_{k+1} (none after the last draft)
        z = tl.sum(tl.load(mass_ptr + (d_start + k + 1) * num_blocks + nb, mask=nb < blocks, other=0.0), 0)
        denom = z + 1.0 - rho
        h = tl.where(k + 1 < n, tl.where(denom > 0, z / tl.where(denom > 0, denom, 1.0), 1.0), rho)
        hit = tl.load(uniform_ptr + d_start + k) < h  # τ = the last k whose coin is below h_k
        accepted = tl.where(hit, k + 1, accepted)
        rho_acc = tl.where(hit, rho, rho_acc)
    tl.store(out_acc_ptr + r, accepted)
    tl.store(out_scale_ptr + r, tl.where(accepted < n, rho_acc, 1.0).to(tl.float32))
    if FROM_LOGITS:
        tl.store(fin_max_ptr + r, tl.load(stat_max_ptr + p_start + accepted))
        tl.store(fin_sum_ptr + r, tl.load(stat_sum_ptr + p_start + accepted))


def block(
    target_probs: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor,  # [Σℓ_r, V]
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor | CounterNoise,  # [R, V] float32 Exp(1), or computed in the kernel
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64: inclusive prefix sums of ℓ, or arange(R)·W + ℓ for padded rows
    block_v: int | None = None,
) -> VerifyResult:
    """Triton block verification; same contract as :func:`dspec_cli.runtime.verify.block.block`
    (the final token by the exponential race only). ``cu`` locates the rows as in
    :func:`dspec_cli.runtime.verify.triton.chain` (padded rows: :func:`~dspec_cli.runtime.verify.triton.grid_ends`)."""
    return _block(target_probs, None, draft_tokens, draft_probs, num_draft, uniforms, noise, total, width, cu, block_v)


def block_logits(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    temperature: float,  # > 0
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor,  # [Σℓ_r, V]
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor | CounterNoise,  # [R, V] float32 Exp(1), or computed in the kernel
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64 (see :func:`block`)
    block_v: int | None = None,
) -> VerifyResult:
    """:func:`block` against softmax(target_logits / temperature), the probabilities never written."""
    return _block(target_logits, temperature, draft_tokens, draft_probs, num_draft, uniforms, noise, total, width, cu,
                  block_v)


def _block(target, temperature: float | None, draft_tokens, draft_probs, num_draft, uniforms, noise, total: int,
           width: int, cu, block_v: int | None) -> VerifyResult:
    check_device(target.device)
    R, (rows, vocab), dev = num_draft.numel(), target.shape, target.device
    if R == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return VerifyResult(empty, torch.full((0, width + 1), -1, dtype=torch.long, device=dev), empty + 1)
    target, q = _rows_2d(target), _rows_2d(draft_probs)
    drafts, ends = draft_tokens.contiguous(), draft_ends(num_draft, cu)
    stats = fin = (target, target)  # unused placeholders unless from logits
    if temperature is not None:
        part_max, part_sum, n_stat = row_partials(target, temperature, block_v)
        stats = tuple(torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(2))
        _run(K.row_softmax_kernel, (triton.cdiv(rows, STATS_ROWS),), part_max, part_sum, *stats, rows, n_stat,
             BLOCK_R=STATS_ROWS, NB=triton.next_power_of_2(n_stat))
        fin = tuple(torch.empty(R, dtype=torch.float32, device=dev) for _ in range(2))
    temp = 1.0 if temperature is None else temperature
    block_size = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))
    num_blocks = triton.cdiv(vocab, block_size)
    mass = torch.zeros(max(total, 1), num_blocks, dtype=torch.float64, device=dev)
    if width > 1:
        _run(_mass_kernel, (R, width, num_blocks), target, drafts, q, num_draft, ends, *stats, mass,
             target.stride(0), q.stride(0), vocab, num_blocks, temp, FROM_LOGITS=temperature is not None,
             BLOCK_V=block_size)  # fmt: skip
    accepted = torch.empty(R, dtype=torch.long, device=dev)
    scale = torch.empty(R, dtype=torch.float32, device=dev)
    _run(
        _decide_kernel, (R,),
        target, drafts, q, num_draft, ends, *stats, mass, uniforms.contiguous(), accepted, scale, *fin,
        target.stride(0), q.stride(0), num_blocks, temp, FROM_LOGITS=temperature is not None,
        BLOCK_NB=triton.next_power_of_2(num_blocks),
    )  # fmt: skip
    return _race(target, temperature, drafts, q, num_draft, ends, uniforms, noise, accepted, True,
                 fin if temperature is not None else None, scale, width, block_v)
