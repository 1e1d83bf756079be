"""Triton kernels of the verifier and the target's draw (launched by :mod:`.triton`).

Every kernel that touches the vocabulary splits it across programs: program (row, block) reduces
``BLOCK_V`` entries of one row to a few partials (a maximum and its first index, a sum), and a
small per-request kernel combines a row's partials and decides. So the work of one call spreads
over rows x blocks programs and a call costs about one read of the rows it needs.

Flat ragged layout (see :mod:`dspec_cli.runtime.verify`): request r has ℓ_r drafts; ``cu`` holds
the inclusive prefix sums of ℓ, so its drafts start at cu[r] - ℓ_r and its target rows at that
plus r. Padded rows (W drafts and W + 1 target rows per request, flattened) are the same layout
with cu[r] = r·W + ℓ_r. Partials are [rows, n_blocks] row-major.

Randomness: coins and explicit noise are read; counter noise (``HASHED``) is computed in the
kernel with the integer hash of :func:`dspec_cli.core.sampling.exponential` (lane 0 of the key
(salt, seed, offset), then one absorb of the token id), so it equals that function's tensor
bit for bit before the final ``-log``.

Maxima use ``tl.max(..., return_indices=True, return_indices_tie_break_left=True)`` (the first
index on ties, as ``torch.argmax``); across blocks the first index is the smallest index among
the blocks that reach the maximum. Triton binds its standard library to the interpreter only
when ``TRITON_INTERPRET=1`` is set before ``import triton``.
"""

# Triton's reductions are annotated as returning a tensor or a tuple: the kernels are checked by
# Triton's compiler, not by pyright.
# pyright: reportAttributeAccessIssue=false, reportOperatorIssue=false, reportCallIssue=false, reportArgumentType=false

from __future__ import annotations

import triton
import triton.language as tl

# -- counter-based noise (core/sampling.py's hash on uint32 lanes) ----------------------


@triton.jit
def _absorb(h, word):
    """Fold a uint32 word into the uint32 lane state h: core.sampling._absorb_spread of
    _mul32(word, golden), the 32-bit avalanche written out (uint32 arithmetic wraps mod 2^32)."""
    h = h + word * 0x9E3779B9
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _key_state(seed, offset, salt):
    """Lane-0 state of the key (salt, seed, offset): core.sampling._lanes(...)[0] for one key."""
    seed = seed.to(tl.int64)
    offset = offset.to(tl.int64)
    h = tl.full((), 0x243F6A88, tl.uint32)
    h = _absorb(h, salt.to(tl.int64).to(tl.uint32))
    h = _absorb(h, seed.to(tl.uint32))
    h = _absorb(h, (seed >> 32).to(tl.uint32))
    h = _absorb(h, offset.to(tl.uint32))
    return _absorb(h, (offset >> 32).to(tl.uint32))


@triton.jit
def _exp_noise(state, tokens):
    """Exp(1) noise of token ids [BLOCK] under a key state: core.sampling.exponential's values."""
    h = _absorb(state, tokens.to(tl.uint32))
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (0, 1), 23 bits, exact
    return -tl.log(u)


@triton.jit
def _first_argmax(val_ptr, idx_ptr, at, valid):
    """The index (idx_ptr) of the largest value (val_ptr) among the partials at ``at`` [N] where
    ``valid``, the smallest index among ties: blocks cover the vocabulary in order."""
    values = tl.load(val_ptr + at, mask=valid, other=-float("inf"))
    index = tl.load(idx_ptr + at, mask=valid, other=2147483647)
    return tl.min(tl.where(values == tl.max(values, 0), index, 2147483647), 0)


# -- greedy verification and the target's draw -----------------------------------------


@triton.jit(do_not_specialize=["salt"])
def block_argmax_kernel(
    logits_ptr,  # [rows, V] (row stride logits_stride)
    seed_ptr,  # [rows] int64 (GUMBEL only)
    offset_ptr,  # [rows] int64 (GUMBEL only)
    part_val_ptr,  # [rows, n_blocks] float32
    part_idx_ptr,  # [rows, n_blocks] int32
    logits_stride,
    vocab,
    n_blocks,
    temperature,
    salt,
    GUMBEL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per (row, block): the first argmax of the logits, or with GUMBEL of z / T - log(E), E the
    counter noise of the row's key: argmax of exp(z / T) / E, the exponential race over
    softmax(z / T) without normalising."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < vocab
    z = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=-float("inf")).to(tl.float32)
    if GUMBEL:
        state = _key_state(tl.load(seed_ptr + row), tl.load(offset_ptr + row), salt)
        z = tl.where(valid, z / temperature - tl.log(_exp_noise(state, offs)), -float("inf"))
    best, i = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_val_ptr + row * n_blocks + b, best)
    tl.store(part_idx_ptr + row * n_blocks + b, b * BLOCK_V + i)


@triton.jit
def greedy_decide_kernel(
    part_val_ptr,  # [rows, n_blocks] float32
    part_idx_ptr,  # [rows, n_blocks] int32
    draft_tok_ptr,  # [Σℓ] int64
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end (module docstring)
    out_tok_ptr,  # [R, out_width] int64
    out_acc_ptr,  # [R] int64
    out_num_ptr,  # [R] int64
    n_blocks,
    out_width,
    HAS_DRAFTS: tl.constexpr,
    WIDTH: tl.constexpr,  # power of 2 >= out_width
    NB: tl.constexpr,  # power of 2 >= n_blocks
):
    """Per request: each of its ℓ + 1 rows' argmax from the partials; accept drafts while they
    equal it; the token after them is the argmax of the row at the first mismatch (the bonus
    row if none). Without drafts (HAS_DRAFTS False) every request has one row."""
    r = tl.program_id(0).to(tl.int64)
    if HAS_DRAFTS:
        n = tl.load(num_draft_ptr + r)
        d_start = tl.load(cu_ptr + r) - n
    else:
        n = 0
        d_start = 0
    k = tl.arange(0, WIDTH)
    blk = tl.arange(0, NB)
    rows = d_start + r + k  # [WIDTH] target rows of this request
    tile = (k[:, None] <= n) & (blk[None, :] < n_blocks)
    at = rows[:, None] * n_blocks + blk[None, :]
    vals = tl.load(part_val_ptr + at, mask=tile, other=-float("inf"))
    idxs = tl.load(part_idx_ptr + at, mask=tile, other=2147483647)
    best = tl.max(vals, 1)
    arg = tl.min(tl.where(vals == best[:, None], idxs, 2147483647), 1).to(tl.int64)  # [WIDTH]
    x = tl.load(draft_tok_ptr + d_start + k, mask=k < n, other=-1)
    accepted = tl.min(tl.where((k < n) & (x == arg), WIDTH, k), 0)  # the first mismatch, <= n
    final = tl.sum(tl.where(k == accepted, arg, 0), 0)
    out = tl.where(k < accepted, x, tl.where(k == accepted, final, -1))
    tl.store(out_tok_ptr + r * out_width + k, out, mask=k < out_width)
    tl.store(out_acc_ptr + r, accepted.to(tl.int64))
    tl.store(out_num_ptr + r, accepted.to(tl.int64) + 1)


# -- chain verification -------------------------------------------------------------------


@triton.jit
def row_stats_kernel(
    logits_ptr,  # [rows, V] (row stride logits_stride)
    part_max_ptr,  # [rows, n_blocks] float32
    part_sum_ptr,  # [rows, n_blocks] float32
    logits_stride,
    vocab,
    n_blocks,
    temperature,
    BLOCK_V: tl.constexpr,
):
    """Per (row, block): m = max(z / T) and Σ exp(z / T - m), the softmax's partials."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < vocab
    z = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=-float("inf")).to(tl.float32)
    z = z / temperature
    m = tl.max(z, 0)
    s = tl.sum(tl.where(z > -float("inf"), tl.exp(z - tl.where(m > -float("inf"), m, 0.0)), 0.0), 0)
    tl.store(part_max_ptr + row * n_blocks + b, m)
    tl.store(part_sum_ptr + row * n_blocks + b, s)


@triton.jit
def _softmax_stats(part_max_ptr, part_sum_ptr, rows, row_mask, n_blocks, NB: tl.constexpr):
    """Row maximum m and Σ exp(z / T - m) of rows [W] from their partials: ([W], [W]); 0 and 1
    on masked rows."""
    blk = tl.arange(0, NB)
    tile = row_mask[:, None] & (blk[None, :] < n_blocks)
    at = rows[:, None] * n_blocks + blk[None, :]
    m_b = tl.load(part_max_ptr + at, mask=tile, other=-float("inf"))
    s_b = tl.load(part_sum_ptr + at, mask=tile, other=0.0)
    m = tl.max(m_b, 1)
    m = tl.where(m > -float("inf"), m, 0.0)  # rows without a finite logit (padding): any finite value
    scale = tl.where(m_b > -float("inf"), tl.exp(m_b - m[:, None]), 0.0)
    return m, tl.where(row_mask, tl.sum(s_b * scale, 1), 1.0)


@triton.jit
def _accepted(p_x, draft_prob_ptr, q_stride, uniform_ptr, d_start, x, k, n, HAS_Q: tl.constexpr, WIDTH: tl.constexpr):
    """Length of the accepted prefix: drafts k < n in order while coin_k < min(1, p(x_k)/q(x_k))
    in float64 (q = 1 without draft probabilities; q(x) = 0 accepts iff p(x) > 0)."""
    is_draft = k < n
    p64 = p_x.to(tl.float64)
    if HAS_Q:
        q_x = tl.load(draft_prob_ptr + (d_start + k) * q_stride + x, mask=is_draft, other=1.0).to(tl.float32)
        ratio = p64 / tl.where(q_x > 0, q_x.to(tl.float64), 1.0)
        prob = tl.where(q_x > 0, tl.minimum(ratio, 1.0), tl.where(p_x > 0, 1.0, 0.0))
    else:
        prob = tl.minimum(p64, 1.0)
    coin = tl.load(uniform_ptr + d_start + k, mask=is_draft, other=1.0)
    return tl.min(tl.where(is_draft & (coin < prob), WIDTH, k), 0)  # the first rejection, <= n


@triton.jit
def chain_accept_kernel(
    logits_ptr,  # [Σ(ℓ+1), V] target logits (row stride logits_stride)
    part_max_ptr,  # [Σ(ℓ+1), n_blocks] from row_stats_kernel
    part_sum_ptr,  # [Σ(ℓ+1), n_blocks]
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] (row stride q_stride; unused unless HAS_Q)
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end (module docstring)
    uniform_ptr,  # [Σℓ] float64 coins
    out_acc_ptr,  # [R] int64
    fin_max_ptr,  # [R] float32: softmax statistics of the row the final token comes from
    fin_sum_ptr,  # [R] float32
    logits_stride,
    q_stride,
    n_blocks,
    temperature,
    HAS_Q: tl.constexpr,
    WIDTH: tl.constexpr,  # power of 2 >= max ℓ + 1
    NB: tl.constexpr,
):
    """Per request, from logits: p(x_k) = softmax(z / T)[x_k] of every draft, the accepted
    prefix (coin < min(1, p / q)) and the softmax statistics of the final row."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    k = tl.arange(0, WIDTH)
    rows = d_start + r + k
    m, s = _softmax_stats(part_max_ptr, part_sum_ptr, rows, k <= n, n_blocks, NB)
    is_draft = k < n
    x = tl.load(draft_tok_ptr + d_start + k, mask=is_draft, other=0)
    z_x = tl.load(logits_ptr + rows * logits_stride + x, mask=is_draft, other=0.0).to(tl.float32)
    p_x = tl.exp(z_x / temperature - m) / s
    accepted = _accepted(p_x, draft_prob_ptr, q_stride, uniform_ptr, d_start, x, k, n, HAS_Q, WIDTH)
    tl.store(out_acc_ptr + r, accepted.to(tl.int64))
    tl.store(fin_max_ptr + r, tl.sum(tl.where(k == accepted, m, 0.0), 0))
    tl.store(fin_sum_ptr + r, tl.sum(tl.where(k == accepted, s, 0.0), 0))


@triton.jit
def target_probs(target_ptr, stride, row, cols, valid, m, s, temperature, FROM_LOGITS: tl.constexpr):
    """Target probabilities of ``row`` at ``cols`` (0 where not ``valid``), float32: read, or from
    logits exp(z / T - m) / s with the row's softmax statistics m, s (unused otherwise)."""
    at = target_ptr + row.to(tl.int64) * stride + cols
    if FROM_LOGITS:
        z = tl.load(at, mask=valid, other=-float("inf")).to(tl.float32)
        return tl.where(valid, tl.exp(z / temperature - m) / s, 0.0)
    return tl.load(at, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def row_softmax_kernel(
    part_max_ptr,  # [rows, n_blocks] from row_stats_kernel
    part_sum_ptr,  # [rows, n_blocks]
    stat_max_ptr,  # [rows] float32: max(z / T)
    stat_sum_ptr,  # [rows] float32: Σ exp(z / T - max)
    rows,
    n_blocks,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
):
    """Per BLOCK_R rows: the softmax statistics of each row from its blocks' partials."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = row < rows
    m, s = _softmax_stats(part_max_ptr, part_sum_ptr, row, ok, n_blocks, NB)
    tl.store(stat_max_ptr + row, m, mask=ok)
    tl.store(stat_sum_ptr + row, s, mask=ok)


@triton.jit(do_not_specialize=["salt"])
def race_partials_kernel(
    target_ptr,  # [Σ(ℓ+1), V] probabilities, or logits with FROM_LOGITS (row stride target_stride)
    draft_tok_ptr,  # [Σℓ] int64
    draft_prob_ptr,  # [Σℓ, V] (row stride q_stride; unused unless HAS_Q)
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64, where each request's drafts end (module docstring)
    uniform_ptr,  # [Σℓ] float64 coins (unused when DECIDED)
    noise_ptr,  # [R, V] float32 Exp(1) (row stride noise_stride; unused with HASHED)
    seed_ptr,  # [R] int64 (HASHED only)
    offset_ptr,  # [R] int64 (HASHED only)
    acc_ptr,  # [R] int64: written here, or read when DECIDED (chain_accept_kernel, the block rule's decision)
    scale_ptr,  # [R] float32: the residual's weight of the target row (SCALED only: the block rule's ρ_τ)
    fin_max_ptr,  # [R] float32 (FROM_LOGITS only): softmax statistics of the row the final token comes from
    fin_sum_ptr,  # [R] float32 (FROM_LOGITS only)
    part_res_ptr,  # [R, n_blocks] float32: best residual race score
    part_res_idx_ptr,  # [R, n_blocks] int32
    part_p_ptr,  # [R, n_blocks] float32: best target race score
    part_p_idx_ptr,  # [R, n_blocks] int32
    part_top_ptr,  # [R, n_blocks] float32: largest residual entry
    target_stride,
    q_stride,
    noise_stride,
    vocab,
    n_blocks,
    temperature,
    salt,
    FROM_LOGITS: tl.constexpr,
    DECIDED: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_Q: tl.constexpr,
    HASHED: tl.constexpr,
    WIDTH: tl.constexpr,  # power of 2 >= max ℓ + 1
    BLOCK_V: tl.constexpr,
):
    """Per (request, block) of the row the final token comes from (the first rejected draft's,
    else the bonus row): exponential-race partials of the residual max(ρ·p - q, 0) (ρ = 1 unless
    SCALED) and of p.

    Unless DECIDED the accepted prefix is computed here by the token rule (cheap: one load per
    draft) and stored by block 0. Race scores are IEEE divisions (tl.div_rn), as the torch
    reference."""
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    p_start = d_start + r
    if DECIDED:
        accepted = tl.load(acc_ptr + r)
    else:
        k = tl.arange(0, WIDTH)
        x = tl.load(draft_tok_ptr + d_start + k, mask=k < n, other=0)
        p_x = tl.load(target_ptr + (p_start + k) * target_stride + x, mask=k < n, other=0.0).to(tl.float32)
        accepted = _accepted(p_x, draft_prob_ptr, q_stride, uniform_ptr, d_start, x, k, n, HAS_Q, WIDTH).to(tl.int64)
        tl.store(acc_ptr + r, accepted, mask=b == 0)
    rejected = accepted < n

    offs = b * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < vocab
    if FROM_LOGITS:
        m, s = tl.load(fin_max_ptr + r), tl.load(fin_sum_ptr + r)
    else:
        m, s = 0.0, 1.0
    p = target_probs(target_ptr, target_stride, p_start + accepted, offs, valid, m, s, temperature, FROM_LOGITS)
    if HAS_Q:
        q_len = tl.where(rejected, vocab, 0)  # q's row is read only after a rejection
        q_row = (d_start + accepted) * q_stride
        q = tl.load(draft_prob_ptr + q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
    else:
        x_rej = tl.load(draft_tok_ptr + d_start + accepted, mask=rejected, other=-1)
        q = tl.where(offs == x_rej, 1.0, 0.0)
    if SCALED:
        res = tl.maximum(tl.load(scale_ptr + r) * p - q, 0.0)
    else:
        res = tl.maximum(p - q, 0.0)
    if HASHED:
        e = _exp_noise(_key_state(tl.load(seed_ptr + r), tl.load(offset_ptr + r), salt), offs)
    else:
        e = tl.load(noise_ptr + r * noise_stride + offs, mask=valid, other=1.0)
    s_res = tl.where(valid, tl.div_rn(res, e), -1.0)
    s_p = tl.where(valid, tl.div_rn(p, e), -1.0)
    best_res, i_res = tl.max(s_res, 0, return_indices=True, return_indices_tie_break_left=True)
    best_p, i_p = tl.max(s_p, 0, return_indices=True, return_indices_tie_break_left=True)
    at = r * n_blocks + b
    tl.store(part_res_ptr + at, best_res)
    tl.store(part_res_idx_ptr + at, b * BLOCK_V + i_res)
    tl.store(part_p_ptr + at, best_p)
    tl.store(part_p_idx_ptr + at, b * BLOCK_V + i_p)
    tl.store(part_top_ptr + at, tl.max(res, 0))


@triton.jit
def race_decide_kernel(
    draft_tok_ptr,  # [Σℓ] int64
    num_draft_ptr,  # [R] int64
    cu_ptr,  # [R] int64
    acc_ptr,  # [R] int64 accepted prefix lengths
    part_res_ptr,  # [R, n_blocks] (race_partials_kernel's outputs)
    part_res_idx_ptr,
    part_p_ptr,
    part_p_idx_ptr,
    part_top_ptr,
    out_tok_ptr,  # [R, out_width] int64
    out_num_ptr,  # [R] int64
    n_blocks,
    out_width,
    WIDTH: tl.constexpr,  # power of 2 >= out_width
    NB: tl.constexpr,
):
    """Per request: the race winner of the residual (of p when the residual is all zero), after
    the accepted drafts; -1 after it."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + r)
    d_start = tl.load(cu_ptr + r) - n
    accepted = tl.load(acc_ptr + r)
    blk = tl.arange(0, NB)
    ok = blk < n_blocks
    at = r * n_blocks + blk
    tok_res = _first_argmax(part_res_ptr, part_res_idx_ptr, at, ok)
    tok_p = _first_argmax(part_p_ptr, part_p_idx_ptr, at, ok)
    any_res = tl.max(tl.load(part_top_ptr + at, mask=ok, other=0.0), 0) > 0
    final = tl.where(any_res, tok_res, tok_p).to(tl.int64)
    k = tl.arange(0, WIDTH)
    x = tl.load(draft_tok_ptr + d_start + k, mask=k < accepted, other=-1)
    out = tl.where(k < accepted, x, tl.where(k == accepted, final, -1))
    tl.store(out_tok_ptr + r * out_width + k, out, mask=k < out_width)
    tl.store(out_num_ptr + r, accepted + 1)
