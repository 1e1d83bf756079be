"""Block verification of draft chains: the torch reference (any device, vectorised over requests).

The rule is Algorithm 2 of Sun et al., "Block Verification Accelerates Speculative Decoding"
(ICLR 2025, arXiv 2403.10444, §3). For one request with drafts x_1..x_ℓ, x_k drawn from q_k, and
target rows p_1..p_{ℓ+1} (p_k scores position k, p_{ℓ+1} is the bonus row):

* prefix weights ρ_0 = 1, ρ_k = min(1, ρ_{k−1} · p_k(x_k) / q_k(x_k));
* residuals r_k = max(ρ_k · p_{k+1} − q_{k+1}, 0) with mass Z_k = Σ r_k, for k < ℓ;
* stop probabilities h_k = Z_k / (Z_k + 1 − ρ_k) for 1 <= k < ℓ, and h_ℓ = ρ_ℓ;
* with one coin η_k per draft, τ = the largest k with η_k < h_k (0 if none): x_1..x_τ are
  committed, then one token from r_τ / Z_τ if τ < ℓ (r_0 is token verification's residual
  max(p_1 − q_1, 0)), else the bonus token from p_{ℓ+1}.

Why it is exact (the paper's Theorem 1, in short). Averaging over the drafts after x_k,
E[ρ_{k+1} | x_≤k] = Σ_x min(q_{k+1}(x), ρ_k p_{k+1}(x)) = ρ_k − Z_k, and backward induction from
P(τ >= ℓ | x) = ρ_ℓ gives P(τ >= k | x_≤k) = 1 − (1 − h_k)(1 − ρ_k + Z_k) = ρ_k and
P(τ = k | x_≤k) = h_k (1 − ρ_k + Z_k) = Z_k. So a block x_≤k followed by token y is emitted with
probability Q(x_≤k) r_k(y) = m_k p_{k+1}(y) − m_{k+1}(x_≤k, y), where Q is the draft probability
of the block and m_k = Q(x_≤k) ρ_k = min(Q(x_≤k), m_{k−1} p_k(x_k)), m_0 = 1. Summed against
the target's continuation these terms telescope: every sequence s comes out with probability
m_0 · P_target(s) = P_target(s). (When Z_k + 1 − ρ_k = 0, i.e. ρ_k = 1 and p_{k+1} = q_{k+1},
h_k is never decisive: P(τ = k) = Z_k = 0; the rule takes h_k = 1.)

Never worse than token verification: ρ_k >= ρ_{k−1} · min(1, p_k(x_k) / q_k(x_k)), so for every
draft prefix x_≤k, averaged over the drafts after it, P(τ >= k | x_≤k) = ρ_k is at least token
verification's Π_{j<=k} min(1, p_j(x_j) / q_j(x_j)) (for one fixed block of drafts it can be less).
For one-hot drafts (q_k = δ_{x_k}) both are Π p_j(x_j): block verification gains nothing there,
and the verifier uses the token rule. At T = 0 (one-hot p and q) τ is the number of leading
drafts equal to the target's argmax, as in greedy verification.

Cost: one vocabulary pass per draft position (Z_1..Z_{ℓ−1}) besides the final token's, where
token verification reads only the draft tokens' probabilities and one residual row.

``prefix_weights``, ``residual_weights`` and ``stop_probs`` are looked up at call time, so tests
can swap in biased versions. The Triton backend (:mod:`dspec_cli.runtime.verify.triton_block`)
computes the same numbers (the masses Z_k to float64 rounding; everything else bit for bit).
"""

from __future__ import annotations

import torch

from dspec_cli.core.sampling import CounterNoise
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import reference


def prefix_weights(
    p_x: torch.Tensor,  # [R, L] target probability of each draft
    q_x: torch.Tensor,  # [R, L] draft probability of each draft
) -> torch.Tensor:
    """ρ [R, L+1] float64: ρ_0 = 1, ρ_k = min(1, ρ_{k−1} p(x_k) / q(x_k)); q(x_k) = 0 counts as an
    infinite ratio when p(x_k) > 0 (the limit; the drafter cannot have drawn such a token), and a
    weight that reached 0 stays 0."""
    p64, q64 = p_x.double(), q_x.double()
    ratio = torch.where(q_x > 0, p64 / torch.where(q_x > 0, q64, 1.0), torch.where(p_x > 0, torch.inf, 0.0))
    rho = [p64.new_ones(p_x.shape[0])]
    for k in range(p_x.shape[1]):
        prev = rho[-1]
        rho.append(torch.where(prev > 0, torch.minimum(prev * ratio[:, k], torch.ones_like(prev)), 0.0))
    return torch.stack(rho, 1)


def residual_weights(
    p: torch.Tensor,  # [..., V] target probabilities
    q: torch.Tensor,  # [..., V] draft probabilities
    rho: torch.Tensor,  # [...] float64 prefix weights
) -> torch.Tensor:
    """max(ρ·p − q, 0) [..., V] float32 (unnormalised)."""
    return (rho.float()[..., None] * p.float() - q.float()).clamp(min=0)


def stop_probs(
    rho: torch.Tensor,  # [R, L+1] float64 prefix weights
    mass: torch.Tensor,  # [R, L] float64: Z_k in column k (column 0 unused)
    num_draft: torch.Tensor,  # [R] long
) -> torch.Tensor:
    """h [R, L] float64, column k − 1 holding h_k: Z_k / (Z_k + 1 − ρ_k) for k < ℓ_r (1 where the
    denominator vanishes), ρ_ℓ at k = ℓ_r, 0 past the drafts."""
    L = mass.shape[1]
    k = torch.arange(1, L + 1, device=rho.device)
    z = torch.cat([mass[:, 1:], torch.zeros_like(mass[:, :1])], 1)  # Z_k for k = 1..L
    r = rho[:, 1:]
    denom = z + 1.0 - r
    inner = torch.where(denom > 0, z / torch.where(denom > 0, denom, 1.0), 1.0)
    n = num_draft[:, None]
    return torch.where(k < n, inner, torch.where(k == n, r, 0.0))


def block(
    target_probs: torch.Tensor,  # [R·(W+1), V]
    draft_tokens: torch.Tensor,  # [R·W] long
    draft_probs: torch.Tensor,  # [R·W, V]
    num_draft: torch.Tensor,  # [R] long, each <= W
    uniforms: torch.Tensor,  # [R·W] float64 in (0, 1): the coin of draft k decides h_k
    noise: torch.Tensor | CounterNoise | None,  # [R, V] Exp(1) (or its keys) for the final token's race (None with final_uniforms)
    total: int,
    width: int,
    *,
    final_uniforms: torch.Tensor | None = None,  # [R] float64 in (0, 1): the final token by inverse CDF
) -> VerifyResult:
    """Block verification over padded rows, flattened: every request has W = ``width`` draft rows
    and W + 1 target rows (total = R·W, host ints).

    Every quantity is computed for all W columns and masked by ℓ_r: a column past a row's drafts
    enters neither ρ_k nor Z_k for k <= ℓ_r (ρ_k reads columns < k, Z_k column k < ℓ_r), h is 0
    there (:func:`stop_probs`) and its coin is masked, so padding cannot change a decision."""
    d_start, p_start, d_idx, valid = reference.layout(num_draft, total, width)
    rows = target_probs.shape[0]
    cols = torch.arange(width, device=num_draft.device)
    p_idx = (p_start[:, None] + cols).clamp(max=rows - 1)  # [R, L]
    x = draft_tokens[d_idx]  # [R, L]
    if total:
        p_x, q_x = target_probs[p_idx, x], draft_probs[d_idx, x]
    else:
        p_x = q_x = torch.zeros(num_draft.numel(), width, device=num_draft.device)
    rho = prefix_weights(p_x, q_x)  # [R, L+1]
    mass = torch.zeros(num_draft.numel(), width, dtype=torch.float64, device=num_draft.device)
    if width > 1:  # Z_k for k = 1..L−1: target row k, draft row k (Z_0 decides nothing)
        res = residual_weights(target_probs[p_idx[:, 1:]], draft_probs[d_idx[:, 1:]], rho[:, 1:width])
        mass[:, 1:] = res.sum(-1, dtype=torch.float64)
    h = stop_probs(rho, mass, num_draft)  # [R, L]
    ok = (uniforms[d_idx] < h) & valid if total else valid
    accepted = (ok.long() * (cols + 1)).amax(1) if width else torch.zeros_like(num_draft)

    # the final token: residual r_τ at τ < ℓ, else the bonus token from p_{ℓ+1}
    p_fin = target_probs.index_select(0, p_start + accepted).float()  # [R, V]
    rejected = accepted < num_draft
    if total:
        q_fin = draft_probs.index_select(0, (d_start + accepted).clamp(max=total - 1)).float()
        q_fin = torch.where(rejected[:, None], q_fin, torch.zeros_like(q_fin))
    else:
        q_fin = torch.zeros_like(p_fin)
    rho_fin = torch.where(rejected, rho.gather(1, accepted[:, None]).squeeze(1), 1.0)
    res = residual_weights(p_fin, q_fin, rho_fin)
    dist = torch.where((res > 0).any(-1, keepdim=True), res, p_fin)
    final = reference.final_draw(dist, noise, final_uniforms)
    return VerifyResult(accepted, reference.committed(x, accepted, final, width), accepted + 1)
