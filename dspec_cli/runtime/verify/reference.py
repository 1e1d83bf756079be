"""Torch reference verifier (any device, vectorised over requests and positions).

Inputs are already validated and the randomness is explicit (see :mod:`dspec_cli.runtime.verify`).
The acceptance rule and the residual are the module-level functions :func:`acceptance_prob`
and :func:`residual`, looked up at call time, so tests can swap them for biased versions.
Block verification's reference is :mod:`dspec_cli.runtime.verify.block`.

The final token of a request is drawn from its weights either by the exponential race with
``noise`` (one Exp(1) vector per request, as the Triton kernels do) or, given
``final_uniforms``, by the inverse CDF with one uniform per request (:func:`final_draw`).
"""

from __future__ import annotations

import torch

from dspec_cli.core.sampling import CounterNoise, sample_from_probs, sample_inverse_cdf
from dspec_cli.core.types import VerifyResult


def acceptance_prob(
    p_x: torch.Tensor,  # [...] target probability of each draft
    q_x: torch.Tensor,  # [...] its draft probability
) -> torch.Tensor:
    """min(1, p(x)/q(x)) [...] in float64; q(x) = 0 gives 1 if p(x) > 0 else 0 (no division by 0)."""
    p64, q64 = p_x.double(), q_x.double()
    ratio = p64 / torch.where(q_x > 0, q64, torch.ones_like(q64))
    return torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).double())


def residual(
    p: torch.Tensor,  # [..., V] target probabilities
    q: torch.Tensor,  # [..., V] draft probabilities
) -> torch.Tensor:
    """Unnormalised residual max(0, p - q) [..., V]."""
    return (p - q).clamp(min=0)


def final_draw(
    weights: torch.Tensor,  # [R, V] unnormalised
    noise: torch.Tensor | CounterNoise | None,  # [R, V] Exp(1) (or its counter keys): the exponential race
    final_uniforms: torch.Tensor | None,  # [R] float64 in (0, 1): the inverse CDF
) -> torch.Tensor:
    """One token [R] per row of ``weights``, from whichever source of randomness is given."""
    if final_uniforms is not None:
        return sample_inverse_cdf(weights, final_uniforms)
    if noise is None:
        raise ValueError("final_draw: needs noise or final_uniforms")
    if isinstance(noise, CounterNoise):
        noise = noise.tensor(weights.shape[-1])
    return sample_from_probs(weights, noise)


def layout(num_draft: torch.Tensor, total: int, width: int):  # num_draft [R] long
    """Indices of padded rows of ``width`` drafts and ``width + 1`` target rows, flattened.

    Returns d_start [R] (first draft of each request), p_start [R] (its first target row),
    d_idx [R, width] (flat draft index, clamped in range) and valid [R, width].
    """
    R = num_draft.numel()
    rows = torch.arange(R, device=num_draft.device)
    d_start = rows * width
    p_start = d_start + rows
    k = torch.arange(width, device=num_draft.device)
    valid = k < num_draft[:, None]
    d_idx = (d_start[:, None] + k).clamp(max=max(total - 1, 0))
    return d_start, p_start, d_idx, valid


def committed(
    drafts: torch.Tensor,  # [R, width] long
    accepted: torch.Tensor,  # [R] long
    final: torch.Tensor,  # [R] long
    width: int,
) -> torch.Tensor:
    """[R, width+1]: the accepted drafts, then the final token at column ``accepted``; -1 after."""
    k = torch.arange(width, device=drafts.device)
    out = torch.full((accepted.numel(), width + 1), -1, dtype=torch.long, device=drafts.device)
    out[:, :width] = torch.where(k < accepted[:, None], drafts, -1)
    return out.scatter_(1, accepted[:, None], final[:, None])


def chain(
    target_probs: torch.Tensor,  # [R·(W+1), V]
    draft_tokens: torch.Tensor,  # [R·W] long
    draft_probs: torch.Tensor | None,  # [R·W, V] or None (one-hot drafts)
    num_draft: torch.Tensor,  # [R] long, each <= W
    uniforms: torch.Tensor,  # [R·W] float64 in (0, 1)
    noise: torch.Tensor | CounterNoise | None,  # [R, V] Exp(1) for the final token's race (None with final_uniforms)
    total: int,
    width: int,
    *,
    final_uniforms: torch.Tensor | None = None,  # [R] float64 in (0, 1): the final token by inverse CDF
) -> VerifyResult:
    """Chain rejection sampling over padded rows, flattened: every request has W = ``width`` draft
    rows and W + 1 target rows (total = R·W, host ints); columns past ℓ_r are computed and masked."""
    d_start, p_start, d_idx, valid = layout(num_draft, total, width)
    rows = target_probs.shape[0]
    p_idx = (p_start[:, None] + torch.arange(width, device=num_draft.device)).clamp(max=rows - 1)
    x = draft_tokens[d_idx]  # [R, L]
    p_x = target_probs[p_idx, x]
    q_x = draft_probs[d_idx, x] if draft_probs is not None else torch.ones_like(p_x)
    ok = (uniforms[d_idx] < acceptance_prob(p_x, q_x)) & valid
    accepted = ok.long().cumprod(1).sum(1)  # [R]

    # one final token per request: residual at the first rejection, else bonus from p
    p_fin = target_probs.index_select(0, p_start + accepted).float()  # [R, V]
    rejected = (accepted < num_draft)[:, None]
    if total == 0:
        q_fin = torch.zeros_like(p_fin)
    else:
        at = (d_start + accepted).clamp(max=total - 1)
        if draft_probs is None:
            q_fin = torch.zeros_like(p_fin).scatter_(1, draft_tokens[at][:, None], 1.0)
        else:
            q_fin = draft_probs.index_select(0, at).float()
        q_fin = torch.where(rejected, q_fin, torch.zeros_like(q_fin))
    res = residual(p_fin, q_fin)
    dist = torch.where((res > 0).any(-1, keepdim=True), res, p_fin)
    final = final_draw(dist, noise, final_uniforms)
    return VerifyResult(accepted, committed(x, accepted, final, width), accepted + 1)


def greedy(
    target_logits: torch.Tensor,  # [R·(W+1), V]
    draft_tokens: torch.Tensor,  # [R·W] long
    num_draft: torch.Tensor,  # [R] long, each <= W
    total: int,
    width: int,
) -> VerifyResult:
    """Greedy verification over padded rows (as :func:`chain`): accept while draft == argmax; the
    final token is the argmax."""
    _, p_start, d_idx, valid = layout(num_draft, total, width)
    best = target_logits.argmax(-1)  # [R·(W+1)]
    rows = target_logits.shape[0]
    p_idx = (p_start[:, None] + torch.arange(width, device=num_draft.device)).clamp(max=rows - 1)
    x = draft_tokens[d_idx]
    ok = (x == best[p_idx]) & valid
    accepted = ok.long().cumprod(1).sum(1)
    final = best[p_start + accepted]
    return VerifyResult(accepted, committed(x, accepted, final, width), accepted + 1)
