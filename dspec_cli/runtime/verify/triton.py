"""Triton backend: chain, greedy and logits-level verification and the target's draw.

Each call launches a few kernels (:mod:`.triton_kernels`): the vocabulary is split into
blocks, one program per (row, block) reduces its block to partials, and one small program per
request combines them and decides. Arithmetic on given probabilities mirrors
:mod:`dspec_cli.runtime.verify.reference` bit for bit (float64 acceptance ratio, IEEE division
for the race, first index on ties), so both backends give identical tokens for the same explicit
randomness. From logits (temperature folded in, no probabilities written) the tokens agree with
``reference`` on ``logits_to_probs`` except where two candidates are within rounding.

No call reads anything back to the host: sizes come from shapes or are passed in, so the calls
can be captured in a CUDA graph.

CUDA tensors run compiled kernels; CPU tensors need the Triton interpreter, which Triton binds
when ``TRITON_INTERPRET=1`` is set before ``triton`` is first imported.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

from dspec_cli.core.sampling import CounterNoise
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import triton_kernels as K

MIN_BLOCK_V = 1024  # vocabulary entries per program, at least (smaller vocabularies: one block)
MAX_BLOCK_V = 4096
PER_THREAD = 8  # entries per thread: num_warps = BLOCK_V / (32 * PER_THREAD), registers stay low
MAX_BLOCKS = 256  # blocks per row: a request's partials are combined by one program
TARGET_PROGRAMS = 2048  # enough (row, block) programs to keep every SM of a large GPU reading


def interpreting() -> bool:
    """True when the kernels run in the Triton interpreter (TRITON_INTERPRET=1 at ``import triton``)."""
    return not isinstance(K.block_argmax_kernel, triton.runtime.JITFunction)


def check_device(device: torch.device) -> None:
    """Raise ValueError unless the kernels can run on tensors of ``device``."""
    if device.type == "cuda" or interpreting():
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ValueError(
            "backend: TRITON_INTERPRET=1 was set after triton was imported; set it before "
            "(e.g. in the environment of the process) to run the Triton backend on CPU tensors"
        )
    raise ValueError(
        f"backend: 'triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
        "(the Triton interpreter) before triton is imported, or use backend='torch'"
    )


def _block(vocab: int, rows: int, block_v: int | None) -> int:
    """Vocabulary entries per program: about TARGET_PROGRAMS programs over ``rows`` rows."""
    if block_v is None:
        want = triton.next_power_of_2(triton.cdiv(vocab * max(rows, 1), TARGET_PROGRAMS))
        block_v = max(MIN_BLOCK_V, min(MAX_BLOCK_V, want), triton.next_power_of_2(triton.cdiv(vocab, MAX_BLOCKS)))
        block_v = min(block_v, triton.next_power_of_2(max(vocab, 16)))
    if triton.cdiv(vocab, block_v) > MAX_BLOCKS:
        raise ValueError(f"block_v: {block_v} splits V = {vocab} into more than {MAX_BLOCKS} blocks")
    return block_v


def _run(kernel: Any, grid: tuple[int, ...], *args, block_v: int | None = None, **constants) -> None:
    """Launch a kernel: no FMA contraction (the reference's rounding), PER_THREAD entries a thread."""
    if block_v is not None:
        constants.update(BLOCK_V=block_v, num_warps=max(4, min(16, block_v // (32 * PER_THREAD))))
    kernel[grid](*args, enable_fp_fusion=False, **constants)


def _width(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] with unit stride along V (rows may be strided): no copy when it already is."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _outputs(R: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [R, width + 1], accepted [R], num_tokens [R] (every entry written by the kernels)."""
    long = torch.long
    return _scratch((R, width + 1), long, device), _scratch(R, long, device), _scratch(R, long, device)


def _scratch(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _empty(width: int, device) -> VerifyResult:
    tokens, accepted, num_tokens = _outputs(0, width, device)
    return VerifyResult(accepted, tokens, num_tokens)


def draft_ends(
    num_draft: torch.Tensor,  # [R] int64
    cu: torch.Tensor | None,  # [R] int64, or None
) -> torch.Tensor:
    """Where each request's drafts end, [R] int64: ``cu`` as given, else the inclusive prefix sums
    of ℓ (the ragged layout). The kernels find request r's drafts at cu[r] − ℓ_r and its target
    rows at cu[r] − ℓ_r + r, so padded rows of W drafts and W + 1 target rows (flattened) are
    ``cu = arange(R)·W + ℓ`` (:func:`grid_ends`)."""
    return num_draft.cumsum(0) if cu is None else cu


def grid_ends(
    num_draft: torch.Tensor,  # [R] int64, each <= width
    width: int,
) -> torch.Tensor:
    """``cu`` [R] int64 of padded rows: request r's drafts at r·W, its target rows at r·(W + 1)."""
    return torch.arange(num_draft.numel(), device=num_draft.device) * width + num_draft


def _noise_args(noise: torch.Tensor | CounterNoise, dummy: torch.Tensor) -> tuple:
    """(noise, noise row stride, seeds, offsets, salt, HASHED) kernel arguments."""
    if isinstance(noise, CounterNoise):
        return dummy, 0, noise.seeds, noise.offsets, noise.salt, True
    noise = _rows_2d(noise.float())
    return noise, noise.stride(0), dummy, dummy, 0, False


def _race(target, temperature: float | None, draft_tokens, draft_probs, num_draft, cu, uniforms, noise, accepted,
          decided: bool, fin_stats, scale, width: int, block_v: int | None) -> VerifyResult:
    """The final token's race partials and the per-request decision (shared by the chains and
    the block rule): ``temperature`` None reads probabilities, else logits with ``fin_stats``;
    ``decided``: ``accepted`` holds the decision already (else the token rule makes it here);
    ``scale`` [R] float32 or None: the block rule's weight ρ_τ of the target row."""
    R, vocab, dev = num_draft.numel(), target.shape[1], target.device
    block = _block(vocab, R, block_v)
    n_blocks = triton.cdiv(vocab, block)
    tokens, _, num_tokens = _outputs(R, width, dev)
    parts = [_scratch((R, n_blocks), dtype, dev) for dtype in (torch.float32, torch.int32) * 2 + (torch.float32,)]
    q = target if draft_probs is None else _rows_2d(draft_probs)
    noise_t, noise_stride, seeds, offsets, salt, hashed = _noise_args(noise, num_draft)
    fin_max, fin_sum = fin_stats if fin_stats is not None else (target, target)
    _run(
        K.race_partials_kernel, (R, n_blocks),
        target, draft_tokens, q, num_draft, cu, uniforms, noise_t, seeds, offsets, accepted,
        scale if scale is not None else target, fin_max, fin_sum, *parts,
        target.stride(0), q.stride(0), noise_stride, vocab, n_blocks, 1.0 if temperature is None else temperature, salt,
        FROM_LOGITS=temperature is not None, DECIDED=decided, SCALED=scale is not None, HAS_Q=draft_probs is not None,
        HASHED=hashed, WIDTH=_width(width + 1), block_v=block,
    )  # fmt: skip
    _run(
        K.race_decide_kernel, (R,),
        draft_tokens, num_draft, cu, accepted, *parts, tokens, num_tokens, n_blocks, width + 1,
        WIDTH=_width(width + 1), NB=_width(n_blocks),
    )  # fmt: skip
    return VerifyResult(accepted, tokens, num_tokens)


def chain(
    target_probs: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor | None,  # [Σℓ_r, V] or None
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor | CounterNoise,  # [R, V] float32, or computed in the kernel
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64: where each request's drafts end (see draft_ends)
    block_v: int | None = None,
) -> VerifyResult:
    """Triton chain rejection sampling; same contract as :func:`reference.chain`. Two launches
    (race partials with the accepted prefix, then the decision) and, without ``cu``, one
    cumulative sum."""
    check_device(target_probs.device)
    R = num_draft.numel()
    if not R:
        return _empty(width, target_probs.device)
    accepted = _scratch(R, torch.long, target_probs.device)
    return _race(_rows_2d(target_probs), None, draft_tokens, draft_probs, num_draft, draft_ends(num_draft, cu),
                 uniforms, noise, accepted, False, None, None, width, block_v)  # fmt: skip


def chain_logits(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    temperature: float,  # > 0
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    draft_probs: torch.Tensor | None,  # [Σℓ_r, V] or None
    num_draft: torch.Tensor,  # [R] long
    uniforms: torch.Tensor,  # [Σℓ_r] float64
    noise: torch.Tensor | CounterNoise,  # [R, V] float32, or computed in the kernel
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64: where each request's drafts end (see draft_ends)
    block_v: int | None = None,
) -> VerifyResult:
    """Chain rejection sampling against softmax(target_logits / temperature), without writing
    the probabilities: softmax statistics per (row, block), the accepted prefix per request,
    then the final token's race as :func:`chain`. Four launches and, without ``cu``, one
    cumulative sum."""
    check_device(target_logits.device)
    R, dev = num_draft.numel(), target_logits.device
    if not R:
        return _empty(width, dev)
    logits = _rows_2d(target_logits)
    part_max, part_sum, n_blocks = row_partials(logits, temperature, block_v)
    cu = draft_ends(num_draft, cu)
    q = logits if draft_probs is None else _rows_2d(draft_probs)
    accepted = _scratch(R, torch.long, dev)
    fin_max, fin_sum = _scratch(R, torch.float32, dev), _scratch(R, torch.float32, dev)
    _run(
        K.chain_accept_kernel, (R,),
        logits, part_max, part_sum, draft_tokens, q, num_draft, cu, uniforms, accepted, fin_max, fin_sum,
        logits.stride(0), q.stride(0), n_blocks, temperature,
        HAS_Q=draft_probs is not None, WIDTH=_width(width + 1), NB=_width(n_blocks),
    )  # fmt: skip
    return _race(logits, temperature, draft_tokens, draft_probs, num_draft, cu, uniforms, noise, accepted, True,
                 (fin_max, fin_sum), None, width, block_v)  # fmt: skip


def row_partials(logits: torch.Tensor, temperature: float, block_v: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Softmax partials of logits [rows, V] (unit stride along V) at ``temperature``: per
    (row, block) max(z / T) and Σ exp(z / T - max), [rows, n_blocks] each, and n_blocks."""
    rows, vocab = logits.shape
    block = _block(vocab, rows, block_v)
    n_blocks = triton.cdiv(vocab, block)
    part_max, part_sum = (_scratch((rows, n_blocks), torch.float32, logits.device) for _ in range(2))
    _run(K.row_stats_kernel, (rows, n_blocks), logits, part_max, part_sum, logits.stride(0), vocab, n_blocks,
         temperature, block_v=block)  # fmt: skip
    return part_max, part_sum, n_blocks


def _argmax_rows(logits, temperature: float, noise: CounterNoise | None, block_v: int | None):
    """Per (row, block) partials of the argmax (or, with noise, of the Gumbel race)."""
    rows, vocab = logits.shape
    block = _block(vocab, rows, block_v)
    n_blocks = triton.cdiv(vocab, block)
    part_val = _scratch((rows, n_blocks), torch.float32, logits.device)
    part_idx = _scratch((rows, n_blocks), torch.int32, logits.device)
    seeds, offsets, salt = (noise.seeds, noise.offsets, noise.salt) if noise is not None else (part_idx, part_idx, 0)
    _run(
        K.block_argmax_kernel, (rows, n_blocks),
        logits, seeds, offsets, part_val, part_idx, logits.stride(0), vocab, n_blocks, temperature, salt,
        GUMBEL=noise is not None, block_v=block,
    )  # fmt: skip
    return part_val, part_idx, n_blocks


def greedy(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r] long
    num_draft: torch.Tensor,  # [R] long
    total: int,
    width: int,
    *,
    cu: torch.Tensor | None = None,  # [R] int64: where each request's drafts end (see draft_ends)
    block_v: int | None = None,
) -> VerifyResult:
    """Triton greedy verification; same contract as :func:`reference.greedy`. Two launches
    (block argmaxes of every row, then the decision) and, without ``cu``, one cumulative sum."""
    check_device(target_logits.device)
    R, dev = num_draft.numel(), target_logits.device
    tokens, accepted, num_tokens = _outputs(R, width, dev)
    if R:
        part_val, part_idx, n_blocks = _argmax_rows(_rows_2d(target_logits), 1.0, None, block_v)
        _run(
            K.greedy_decide_kernel, (R,),
            part_val, part_idx, draft_tokens, num_draft, draft_ends(num_draft, cu), tokens, accepted, num_tokens,
            n_blocks, width + 1, HAS_DRAFTS=True, WIDTH=_width(width + 1), NB=_width(n_blocks),
        )  # fmt: skip
    return VerifyResult(accepted, tokens, num_tokens)


def draw(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    noise: CounterNoise | None,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """One token per row [N]: the argmax (first index on ties) when ``noise`` is None, else the
    exponential race over softmax(logits / temperature) with the counter noise, computed as
    argmax(logits / T - log E). Two launches; T = 1 costs what T = 0 costs."""
    check_device(logits.device)
    N, dev = logits.shape[0], logits.device
    tokens, accepted, num_tokens = _outputs(N, 0, dev)
    if N:
        part_val, part_idx, n_blocks = _argmax_rows(_rows_2d(logits), temperature, noise, block_v)
        unused = part_idx  # no drafts: the draft pointers are never read
        _run(
            K.greedy_decide_kernel, (N,),
            part_val, part_idx, unused, unused, unused, tokens, accepted, num_tokens, n_blocks, 1,
            HAS_DRAFTS=False, WIDTH=1, NB=_width(n_blocks),
        )  # fmt: skip
    return tokens[:, 0]
