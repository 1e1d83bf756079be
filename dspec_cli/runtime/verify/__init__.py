"""The common verifier: chain, greedy and tree verification over a flattened ragged batch.

Layout (like vLLM): request r proposes ℓ_r >= 0 drafts; its target rows are one per draft
position followed by its bonus row, so target rows number Σ(ℓ_r + 1) and drafts Σℓ_r.

Chains are verified token by token (``method="token"``: each draft accepted with probability
min(1, p/q) until the first rejection) or as a block (``method="block"``, Sun et al. 2025:
:mod:`dspec_cli.runtime.verify.block`), both exact at any temperature; trees by the methods of
:func:`verify_tree`.

Randomness, in order of precedence: explicit ``uniforms`` (the coins) and ``noise`` or
``final_uniforms`` (the final token: an Exp(1) vector per request for the exponential race, or
one uniform per request for the inverse CDF; bit-for-bit comparable across backends), counter-based ``seeds`` / ``offsets`` (per request; ``offsets`` is the
absolute position of the first draft, so numbers never depend on the batch and never repeat
across steps), else ``generator`` (torch randomness). Coins are never exactly 0.

Backends: ``"torch"`` (reference, any device), ``"triton"`` (CUDA, or CPU under
TRITON_INTERPRET=1), ``"auto"`` (Triton on CUDA tensors when it imports, else torch).
Chain and greedy calls synchronise with the host once (ragged lengths and, with ``validate=True``, the
value checks); ``validate=False`` skips the value checks on hot paths.
"""

from __future__ import annotations

import importlib.util

import torch

from dspec_cli.core.sampling import (
    COIN_SALT,
    NOISE_SALT,
    exponential,
    torch_exponential,
    torch_uniform,
    uniform,
)
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import block, checks, reference
from dspec_cli.runtime.verify.tree import verify_tree

__all__ = ["CHAIN_METHODS", "VerifyResult", "triton_available", "verify_chain", "verify_greedy", "verify_tree"]

BACKENDS = ("auto", "torch", "triton")
CHAIN_METHODS = ("token", "block")


def triton_available() -> bool:
    """True when the optional `triton` package is installed (it is imported only when used)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def _backend(backend: str, device: torch.device):
    """The module implementing `chain` / `greedy` for this backend and device (the torch
    reference is :mod:`reference`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "torch":
        return reference
    if not triton_available():
        raise ValueError("backend: 'triton' requested but the triton package is not installed")
    from dspec_cli.runtime.verify import triton as triton_backend

    triton_backend.check_device(device)
    return triton_backend


def _block_backend(impl):
    """The module implementing `block` next to the chain backend ``impl``."""
    if impl is reference:
        return block
    from dspec_cli.runtime.verify import triton_block

    return triton_block


def _ragged_sizes(values, stats, draft_tokens, target, target_name: str, R: int) -> tuple[int, int]:
    """(Σℓ, max ℓ) from the synced stats, checked against the draft [Σℓ] and target [Σ(ℓ+1), V]
    row counts."""
    total, width = (int(values[i]) for i in stats)
    if draft_tokens.numel() != total:
        raise ValueError(f"draft_tokens: has {draft_tokens.numel()} entries but num_draft sums to {total}")
    if target.shape[0] != total + R:
        raise ValueError(f"{target_name}: has {target.shape[0]} rows, expected Σ(num_draft + 1) = {total + R}")
    return total, width


def _chain_coins(num_draft, total, uniforms, generator, seeds, offsets, device) -> torch.Tensor:
    """Coins [Σℓ] float64 from the highest-precedence source: uniforms [Σℓ], else seeds and
    offsets [R] int64 (num_draft [R]), else the generator."""
    if uniforms is None:
        if seeds is not None:
            R = num_draft.numel()
            req = torch.repeat_interleave(torch.arange(R, device=device), num_draft, output_size=total)
            local = torch.arange(total, device=device) - reference.prefix_sums(num_draft)[req]
            uniforms = uniform(seeds[req], offsets[req] + local, COIN_SALT)
        else:
            uniforms = torch_uniform((total,), generator=generator, device=device)
    return uniforms.double()


def _chain_noise(R: int, vocab: int, noise, generator, seeds, offsets, device) -> torch.Tensor:
    """Final-token noise [R, V] float32 from the highest-precedence source: noise [R, V], else
    seeds and offsets [R] int64, else the generator."""
    if noise is None:
        if seeds is not None:
            noise = exponential(seeds, offsets, vocab, NOISE_SALT)
        else:
            noise = torch_exponential((R, vocab), generator=generator, device=device)
    return noise.float()


def verify_chain(
    target_probs: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r]
    draft_probs: torch.Tensor | None,  # [Σℓ_r, V] or None (one-hot drafts)
    num_draft: torch.Tensor,  # [R]
    *,
    method: str = "token",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [Σℓ_r] float64 in (0, 1): one coin per draft
    noise: torch.Tensor | None = None,  # [R, V] Exp(1), > 0: the final token's exponential race
    final_uniforms: torch.Tensor | None = None,  # [R] float64 in (0, 1): the final token by inverse CDF
    seeds: torch.Tensor | None = None,  # [R] int64
    offsets: torch.Tensor | None = None,  # [R] int64
    backend: str = "auto",
    validate: bool = True,
) -> VerifyResult:
    """Chain speculative sampling (lossless at any temperature).

    ``method="token"``: draft x_k is accepted with probability min(1, p(x_k)/q(x_k)) (q = 1 for
    one-hot drafts); at the first rejection the token is drawn from norm(max(0, p - q))
    (one-hot: p with x_k removed; p itself if the residual is all zero), else the bonus token
    from p at row ℓ_r. ``method="block"``: block verification
    (:mod:`dspec_cli.runtime.verify.block`), which accepts at least as many drafts in
    distribution; one-hot drafts (``draft_probs`` None) gain nothing from it and take the token
    rule. The final token is drawn by the exponential race argmax(w / noise) (no
    renormalisation), or, given ``final_uniforms`` (torch backend), by the inverse CDF of w with
    one uniform per request: the same distribution without a vocabulary-wide noise vector
    (cheaper on a CPU).
    """
    if method not in CHAIN_METHODS:
        raise ValueError(f"method: expected one of {CHAIN_METHODS}, got {method!r}")
    checks.tensor("target_probs", target_probs, dim=2, kind="float")
    device, vocab = target_probs.device, target_probs.shape[1]
    checks.tensor("num_draft", num_draft, dim=1, kind="int", device=device)
    checks.tensor("draft_tokens", draft_tokens, dim=1, kind="int", device=device)
    R = num_draft.numel()
    if draft_probs is not None:
        checks.tensor("draft_probs", draft_probs, dim=2, kind="float", device=device)
        checks.shape("draft_probs", draft_probs, (draft_tokens.numel(), vocab))
    if uniforms is not None:
        checks.tensor("uniforms", uniforms, dim=1, kind="float", device=device)
        checks.shape("uniforms", uniforms, (draft_tokens.numel(),))
    if noise is not None:
        checks.tensor("noise", noise, dim=2, kind="float", device=device)
        checks.shape("noise", noise, (R, vocab))
    if final_uniforms is not None:
        if noise is not None:
            raise ValueError("final_uniforms: give either noise or final_uniforms for the final token, not both")
        checks.tensor("final_uniforms", final_uniforms, dim=1, kind="float", device=device)
        checks.shape("final_uniforms", final_uniforms, (R,))
    checks.rng_keys(seeds, offsets, R, device)
    impl = _backend(backend, device)
    if final_uniforms is not None and impl is not reference:
        raise ValueError("final_uniforms: the Triton backend draws the final token with noise; pass noise or seeds")

    c = checks.Checks(device)
    stats = checks.lengths(c, "num_draft", num_draft, validate)
    if validate:
        checks.prob_rows(c, "target_probs", target_probs)
        if draft_probs is not None:
            checks.prob_rows(c, "draft_probs", draft_probs)
        checks.token_range(c, "draft_tokens", draft_tokens, vocab)
        if uniforms is not None:
            checks.open_unit(c, "uniforms", uniforms)
        if noise is not None:
            checks.positive_finite(c, "noise", noise)
        if final_uniforms is not None:
            checks.open_unit(c, "final_uniforms", final_uniforms)
    total, width = _ragged_sizes(c.run(), stats, draft_tokens, target_probs, "target_probs", R)

    num_draft, draft_tokens = num_draft.long(), draft_tokens.long()
    uniforms = _chain_coins(num_draft, total, uniforms, generator, seeds, offsets, device)
    args = (target_probs, draft_tokens, draft_probs, num_draft, uniforms)
    if final_uniforms is not None:  # torch backend only (checked above)
        fu = final_uniforms.double()
        if method == "block" and draft_probs is not None:
            return block.block(target_probs, draft_tokens, draft_probs, num_draft, uniforms, None, total, width,
                               final_uniforms=fu)
        return reference.chain(*args, None, total, width, final_uniforms=fu)
    noise = _chain_noise(R, vocab, noise, generator, seeds, offsets, device)
    if method == "block" and draft_probs is not None:
        return _block_backend(impl).block(target_probs, draft_tokens, draft_probs, num_draft, uniforms, noise, total,
                                          width)
    return impl.chain(*args, noise, total, width)


def verify_greedy(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r]
    num_draft: torch.Tensor,  # [R]
    *,
    backend: str = "auto",
    validate: bool = True,
) -> VerifyResult:
    """Greedy (T = 0) verification: accept while draft == argmax(logits) (first index on
    ties); the correction or bonus token is the argmax at the first mismatch / row ℓ_r."""
    checks.tensor("target_logits", target_logits, dim=2, kind="float")
    device, vocab = target_logits.device, target_logits.shape[1]
    checks.tensor("num_draft", num_draft, dim=1, kind="int", device=device)
    checks.tensor("draft_tokens", draft_tokens, dim=1, kind="int", device=device)
    impl = _backend(backend, device)

    c = checks.Checks(device)
    stats = checks.lengths(c, "num_draft", num_draft, validate)
    if validate:
        checks.no_nan(c, "target_logits", target_logits)
        checks.token_range(c, "draft_tokens", draft_tokens, vocab)
    R = num_draft.numel()
    total, width = _ragged_sizes(c.run(), stats, draft_tokens, target_logits, "target_logits", R)
    return impl.greedy(target_logits, draft_tokens.long(), num_draft.long(), total, width)
