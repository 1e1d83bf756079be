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
value checks); ``validate=False`` skips the value checks on hot paths, and the logits-level calls
(:func:`verify_chain_logits`, :func:`sample_logits`) given ``max_draft`` never synchronise. The
``*_grid`` variants take padded rows instead ([R, W + 1] target rows, [R, W] drafts, lengths on
the device), check shapes only and never read the device: what the engine's static round runs
(chains and greedy on the Triton kernels on CUDA, the torch reference elsewhere; trees on the
torch reference).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from dspec_cli.core.sampling import (
    COIN_SALT,
    NOISE_SALT,
    CounterNoise,
    logits_to_probs,
    sample_from_probs,
    torch_exponential,
    torch_uniform,
    uniform,
)
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import block, checks, reference
from dspec_cli.runtime.verify.tree import verify_tree, verify_tree_grid

__all__ = [
    "CHAIN_METHODS",
    "VerifyResult",
    "sample_logits",
    "triton_available",
    "verify_chain",
    "verify_chain_grid",
    "verify_chain_logits",
    "verify_chain_logits_grid",
    "verify_greedy",
    "verify_greedy_grid",
    "verify_tree",
    "verify_tree_grid",
]

BACKENDS = ("auto", "torch", "triton")
CHAIN_METHODS = ("token", "block")


def triton_available() -> bool:
    """True when the optional `triton` package is installed (it is imported only when used)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def _backend(backend: str, device: torch.device) -> ModuleType:
    """The module implementing `chain` / `greedy` for this backend and device."""
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


def _block_backend(impl: ModuleType) -> ModuleType:
    """The module implementing `block` next to the chain backend ``impl``."""
    if impl is reference:
        return block
    from dspec_cli.runtime.verify import triton_block

    return triton_block


def _ragged_sizes(c: checks.Checks, num_draft, draft_tokens, target, target_name: str, validate: bool,
                  max_draft: int | None) -> tuple[int, int]:
    """(Σℓ, max ℓ), checked against the draft and target row counts; runs the recorded checks.

    Without ``max_draft`` the lengths are read back with the checks (one sync); with it and
    ``validate=False`` nothing is read back.
    """
    R = num_draft.numel()
    if max_draft is None:
        stats = checks.lengths(c, "num_draft", num_draft, validate)
        values = c.run()
        total, width = (int(values[i]) for i in stats)
    else:
        total, width = draft_tokens.numel(), max_draft
        if validate:
            checks.lengths(c, "num_draft", num_draft, validate)
            c.require("max_draft", num_draft.max() == max_draft if R else max_draft == 0, "must equal max(num_draft)")
            c.require("num_draft", num_draft.sum() == total, f"must sum to the {total} draft_tokens")
        c.run()
    if draft_tokens.numel() != total:
        raise ValueError(f"draft_tokens: has {draft_tokens.numel()} entries but num_draft sums to {total}")
    if target.shape[0] != total + R:
        raise ValueError(f"{target_name}: has {target.shape[0]} rows, expected Σ(num_draft + 1) = {total + R}")
    return total, width


def _chain_coins(num_draft, total, uniforms, generator, seeds, offsets, device) -> torch.Tensor:
    """Coins [Σℓ] float64 from the highest-precedence source."""
    if uniforms is None:
        if seeds is not None:
            R = num_draft.numel()
            req = torch.repeat_interleave(torch.arange(R, device=device), num_draft, output_size=total)
            local = torch.arange(total, device=device) - reference.prefix_sums(num_draft)[req]
            uniforms = uniform(seeds[req], offsets[req] + local, COIN_SALT)
        else:
            uniforms = torch_uniform((total,), generator=generator, device=device)
    return uniforms.double()


def _chain_noise(R: int, vocab: int, noise, generator, seeds, offsets, device) -> torch.Tensor | CounterNoise:
    """Final-token noise [R, V] float32 from the highest-precedence source (counter noise by its
    keys: the Triton kernels compute it where they use it)."""
    if noise is None:
        if seeds is not None:
            return CounterNoise(seeds.long(), offsets.long(), NOISE_SALT)
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
    return _chain(
        target_probs, None, draft_tokens, draft_probs, num_draft, method=method, generator=generator, uniforms=uniforms,
        noise=noise, final_uniforms=final_uniforms, seeds=seeds, offsets=offsets, backend=backend,
        validate=validate, max_draft=None,
    )  # fmt: skip


def verify_chain_logits(
    target_logits: torch.Tensor,  # [Σ(ℓ_r+1), V]
    draft_tokens: torch.Tensor,  # [Σℓ_r]
    draft_probs: torch.Tensor | None,  # [Σℓ_r, V] or None (one-hot drafts)
    num_draft: torch.Tensor,  # [R]
    *,
    temperature: float | torch.Tensor = 1.0,  # scalar, or [rows] per target row
    top_k: int | torch.Tensor = 0,  # scalar, or [rows]
    top_p: float | torch.Tensor = 1.0,  # scalar, or [rows]
    method: str = "token",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [Σℓ_r] float64 in (0, 1)
    noise: torch.Tensor | None = None,  # [R, V] Exp(1), > 0
    final_uniforms: torch.Tensor | None = None,  # [R] float64 in (0, 1): final token by inverse CDF
    seeds: torch.Tensor | None = None,  # [R] int64
    offsets: torch.Tensor | None = None,  # [R] int64
    max_draft: int | None = None,  # max ℓ_r when the caller knows it: no read-back of the lengths
    backend: str = "auto",
    validate: bool = True,
) -> VerifyResult:
    """:func:`verify_chain` against ``logits_to_probs(target_logits, temperature, top_k, top_p)``;
    temperature 0 is :func:`verify_greedy` (the same tokens; draft probabilities are not read);
    ``method`` as in :func:`verify_chain`.

    On the Triton backend with temperature alone (scalar top_k = 0, top_p = 1) the target
    probabilities are never written: the kernels reduce softmax statistics per row and compute
    the probabilities they read from the logits (the token rule reads the drafts' entries and one
    row per request, the block rule every draft row). Otherwise the probabilities come from
    ``logits_to_probs`` (the torch reference, and top-k / top-p everywhere).
    """
    if _scalar(temperature) and float(temperature) == 0:
        return _greedy(target_logits, draft_tokens, num_draft, backend, validate, max_draft)
    fused = _scalar(temperature) and _scalar(top_k) and _scalar(top_p) and int(top_k) == 0 and float(top_p) == 1
    if fused and final_uniforms is None and _backend(backend, target_logits.device) is not reference:
        checks.positive("temperature", float(temperature))
        target, temp = target_logits, float(temperature)
    else:
        target, temp = logits_to_probs(target_logits, temperature, top_k, top_p), None
    return _chain(
        target, temp, draft_tokens, draft_probs, num_draft, method=method, generator=generator, uniforms=uniforms, noise=noise,
        final_uniforms=final_uniforms, seeds=seeds, offsets=offsets, backend=backend, validate=validate,
        max_draft=max_draft,
    )  # fmt: skip


def _scalar(value) -> bool:
    return not (isinstance(value, torch.Tensor) and value.dim() > 0)


def _chain(
    target: torch.Tensor,  # [Σ(ℓ_r+1), V] probabilities, or logits when temperature is set
    temperature: float | None,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    *,
    method: str, generator, uniforms, noise, final_uniforms, seeds, offsets, backend: str, validate: bool,
    max_draft: int | None,
) -> VerifyResult:
    """Checks, randomness and dispatch of both chain verifications."""
    if method not in CHAIN_METHODS:
        raise ValueError(f"method: expected one of {CHAIN_METHODS}, got {method!r}")
    name = "target_probs" if temperature is None else "target_logits"
    checks.tensor(name, target, dim=2, kind="float")
    device, vocab = target.device, target.shape[1]
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
    if validate:
        if temperature is None:
            checks.prob_rows(c, name, target)
        else:
            checks.no_nan(c, name, target)
        if draft_probs is not None:
            checks.prob_rows(c, "draft_probs", draft_probs)
        checks.token_range(c, "draft_tokens", draft_tokens, vocab)
        if uniforms is not None:
            checks.open_unit(c, "uniforms", uniforms)
        if noise is not None:
            checks.positive_finite(c, "noise", noise)
        if final_uniforms is not None:
            checks.open_unit(c, "final_uniforms", final_uniforms)
    total, width = _ragged_sizes(c, num_draft, draft_tokens, target, name, validate, max_draft)

    num_draft, draft_tokens = num_draft.long(), draft_tokens.long()
    uniforms = _chain_coins(num_draft, total, uniforms, generator, seeds, offsets, device)
    block_q = draft_probs if method == "block" else None  # one-hot drafts: block = token in law
    if final_uniforms is not None:  # torch backend only (checked above)
        fu = final_uniforms.double()
        if block_q is not None:
            return block.block(target, draft_tokens, block_q, num_draft, uniforms, None, total, width,
                               final_uniforms=fu)
        return reference.chain(target, draft_tokens, draft_probs, num_draft, uniforms, None, total, width,
                               final_uniforms=fu)
    noise = _chain_noise(R, vocab, noise, generator, seeds, offsets, device)
    if block_q is not None:
        args = (draft_tokens, block_q, num_draft, uniforms, noise, total, width)
        if temperature is not None:  # the Triton backend (verify_chain_logits chose it)
            return _block_backend(impl).block_logits(target, temperature, *args)
        return _block_backend(impl).block(target, *args)
    rest = (draft_tokens, draft_probs, num_draft, uniforms, noise, total, width)
    if temperature is not None:  # the Triton backend (verify_chain_logits chose it)
        return impl.chain_logits(target, temperature, *rest)
    return impl.chain(target, *rest)


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
    return _greedy(target_logits, draft_tokens, num_draft, backend, validate, None)


def _greedy(target_logits, draft_tokens, num_draft, backend: str, validate: bool, max_draft: int | None):
    checks.tensor("target_logits", target_logits, dim=2, kind="float")
    device, vocab = target_logits.device, target_logits.shape[1]
    checks.tensor("num_draft", num_draft, dim=1, kind="int", device=device)
    checks.tensor("draft_tokens", draft_tokens, dim=1, kind="int", device=device)
    impl = _backend(backend, device)

    c = checks.Checks(device)
    if validate:
        checks.no_nan(c, "target_logits", target_logits)
        checks.token_range(c, "draft_tokens", draft_tokens, vocab)
    total, width = _ragged_sizes(c, num_draft, draft_tokens, target_logits, "target_logits", validate, max_draft)
    return impl.greedy(target_logits, draft_tokens.long(), num_draft.long(), total, width)


def sample_logits(
    logits: torch.Tensor,  # [N, V]
    seeds: torch.Tensor,  # [N] int64
    offsets: torch.Tensor,  # [N] int64
    *,
    salt: int,
    temperature: float | torch.Tensor = 1.0,  # scalar, or [rows] per target row
    top_k: int | torch.Tensor = 0,  # scalar, or [rows]
    top_p: float | torch.Tensor = 1.0,  # scalar, or [rows]
    backend: str = "auto",
) -> torch.Tensor:
    """One token per row [N] at the sampling settings, keyed by (seed, offset, salt): temperature 0
    gives the argmax (first index on ties), else the exponential race over
    ``logits_to_probs(logits, temperature, top_k, top_p)`` with noise ``exponential(seeds,
    offsets, V, salt)``. Nothing is read back to the host (with scalar settings).

    On the Triton backend with temperature alone the race runs on the logits (argmax of
    logits / T - log E) in one pass over them, so T = 1 costs what T = 0 costs; with top-k /
    top-p the probabilities come from ``logits_to_probs`` and the race from the chain kernels.
    """
    checks.tensor("logits", logits, dim=2, kind="float")
    N, device = logits.shape[0], logits.device
    checks.rng_keys(seeds, offsets, N, device)
    impl = _backend(backend, device)
    noise = CounterNoise(seeds.long(), offsets.long(), salt)
    greedy = _scalar(temperature) and float(temperature) == 0
    if impl is reference:
        if greedy:
            return logits.argmax(-1)
        return sample_from_probs(logits_to_probs(logits, temperature, top_k, top_p), noise.tensor(logits.shape[1]))
    if greedy:
        return impl.draw(logits, 0.0, None)
    if _scalar(temperature) and _scalar(top_k) and _scalar(top_p) and int(top_k) == 0 and float(top_p) == 1:
        checks.positive("temperature", float(temperature))
        return impl.draw(logits, float(temperature), noise)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    bonus_only = torch.zeros(N, dtype=torch.long, device=device)  # no drafts: each row races over p
    coins = torch.empty(0, dtype=torch.float64, device=device)
    return impl.chain(probs, bonus_only[:0], None, bonus_only, coins, noise, 0, 0).tokens[:, 0]


def _grid_shapes(target: torch.Tensor, name: str, draft_tokens: torch.Tensor, num_draft: torch.Tensor) -> tuple[int, int]:
    """(R, W) of a padded chain verification, shapes checked on the host."""
    checks.tensor(name, target, dim=3, kind="float")
    device = target.device
    checks.tensor("draft_tokens", draft_tokens, dim=2, kind="int", device=device)
    R, W = draft_tokens.shape
    checks.shape(name, target, (R, W + 1, None))
    checks.tensor("num_draft", num_draft, dim=1, kind="int", device=device)
    checks.shape("num_draft", num_draft, (R,))
    return R, W


def verify_chain_grid(
    target_probs: torch.Tensor,  # [R, W+1, V]
    draft_tokens: torch.Tensor,  # [R, W]
    draft_probs: torch.Tensor | None,  # [R, W, V] or None (one-hot drafts)
    num_draft: torch.Tensor,  # [R], each <= W
    *,
    method: str = "token",
    uniforms: torch.Tensor,  # [R, W] float64 in (0, 1): draft k's coin
    noise: torch.Tensor | CounterNoise | None = None,  # [R, V] Exp(1) (or its keys): final token by the race
    final_uniforms: torch.Tensor | None = None,  # [R] float64: final token by the inverse CDF
    backend: str = "auto",
) -> VerifyResult:
    """:func:`verify_chain` over padded rows: row r verifies its first ``num_draft[r]`` drafts
    against target rows [r, 0..num_draft[r]] by ``method`` ("token" or "block"; one-hot drafts
    take the token rule, the same law). The padding never decides anything: both references
    compute every column and mask those past ℓ_r (:func:`reference.chain`,
    :func:`block.block`), and the Triton kernels read only a row's own ℓ_r drafts and ℓ_r + 1
    target rows (:func:`triton.grid_ends`), so a row's outcome equals the ragged call's with the
    same randomness. No host reads on either backend.

    ``backend`` as in :func:`verify_chain`; the Triton backend draws the final token by the
    race only, so ``final_uniforms`` takes the torch reference ("auto") or is an error
    ("triton")."""
    if method not in CHAIN_METHODS:
        raise ValueError(f"method: expected one of {CHAIN_METHODS}, got {method!r}")
    R, W = _grid_shapes(target_probs, "target_probs", draft_tokens, num_draft)
    vocab = target_probs.shape[2]
    if draft_probs is not None:
        checks.shape("draft_probs", draft_probs, (R, W, vocab))
    checks.shape("uniforms", uniforms, (R, W))
    if (noise is None) == (final_uniforms is None):
        raise ValueError("verify_chain_grid: give exactly one of noise and final_uniforms for the final token")
    # the inverse-CDF draw is the reference's alone: "auto" takes it there, "triton" is an error
    impl = _backend("torch" if final_uniforms is not None and backend == "auto" else backend, target_probs.device)
    if final_uniforms is not None and impl is not reference:
        raise ValueError("final_uniforms: the Triton backend draws the final token with noise; pass noise")
    if isinstance(noise, torch.Tensor):
        noise = noise.float()
    probs, drafts = target_probs.flatten(0, 1), draft_tokens.flatten().long()
    q = None if draft_probs is None else draft_probs.flatten(0, 1)
    block_q = q if method == "block" else None  # one-hot drafts: block = token in law
    ell, coins = num_draft.long(), uniforms.flatten().double()
    if impl is reference:
        fu = None if final_uniforms is None else final_uniforms.double()
        args = (ell, coins, noise, R * W, W)
        if block_q is not None:
            return block.block(probs, drafts, block_q, *args, final_uniforms=fu, grid=True)
        return reference.chain(probs, drafts, q, *args, final_uniforms=fu, grid=True)
    assert noise is not None  # final_uniforms took the reference above
    cu = impl.grid_ends(ell, W)
    if block_q is not None:
        return _block_backend(impl).block(probs, drafts, block_q, ell, coins, noise, R * W, W, cu=cu)
    return impl.chain(probs, drafts, q, ell, coins, noise, R * W, W, cu=cu)


def verify_chain_logits_grid(
    target_logits: torch.Tensor,  # [R, W+1, V], any float dtype
    draft_tokens: torch.Tensor,  # [R, W]
    draft_probs: torch.Tensor | None,  # [R, W, V] or None (one-hot drafts)
    num_draft: torch.Tensor,  # [R], each <= W
    *,
    temperature: float,  # > 0
    method: str = "token",
    uniforms: torch.Tensor,  # [R, W] float64 in (0, 1): draft k's coin
    noise: torch.Tensor | CounterNoise,  # [R, V] Exp(1) (or its keys): final token by the race
    backend: str = "auto",
) -> VerifyResult:
    """:func:`verify_chain_grid` against ``logits_to_probs(target_logits, temperature)``. On the
    Triton backend the probabilities are never written (nor an fp32 copy of the logits): the
    kernels read the logits as they are and compute the probabilities where they use them, which
    saves a few vocabulary-wide passes per target row (the engine's verify step on CUDA; tokens
    equal the reference's except where two candidates are within rounding). The torch reference
    computes the probabilities first. No host reads."""
    R, W = _grid_shapes(target_logits, "target_logits", draft_tokens, num_draft)
    vocab = target_logits.shape[2]
    impl = _backend(backend, target_logits.device)
    if impl is reference:
        probs = logits_to_probs(target_logits.flatten(0, 1), temperature).view(R, W + 1, vocab)
        return verify_chain_grid(probs, draft_tokens, draft_probs, num_draft, method=method, uniforms=uniforms,
                                 noise=noise, backend="torch")
    if method not in CHAIN_METHODS:
        raise ValueError(f"method: expected one of {CHAIN_METHODS}, got {method!r}")
    checks.positive("temperature", float(temperature))
    if draft_probs is not None:
        checks.shape("draft_probs", draft_probs, (R, W, vocab))
    checks.shape("uniforms", uniforms, (R, W))
    if isinstance(noise, torch.Tensor):
        noise = noise.float()
    logits, drafts, ell = target_logits.flatten(0, 1), draft_tokens.flatten().long(), num_draft.long()
    q = None if draft_probs is None else draft_probs.flatten(0, 1)
    args = (drafts, q, ell, uniforms.flatten().double(), noise, R * W, W)
    cu = impl.grid_ends(ell, W)
    if method == "block" and q is not None:  # one-hot drafts: block = token in law
        return _block_backend(impl).block_logits(logits, float(temperature), *args, cu=cu)
    return impl.chain_logits(logits, float(temperature), *args, cu=cu)


def verify_greedy_grid(
    target_logits: torch.Tensor,  # [R, W+1, V]
    draft_tokens: torch.Tensor,  # [R, W]
    num_draft: torch.Tensor,  # [R], each <= W
    *,
    backend: str = "auto",
) -> VerifyResult:
    """:func:`verify_greedy` over padded rows (see :func:`verify_chain_grid`). No host reads."""
    R, W = _grid_shapes(target_logits, "target_logits", draft_tokens, num_draft)
    impl = _backend(backend, target_logits.device)
    logits, drafts, ell = target_logits.flatten(0, 1), draft_tokens.flatten().long(), num_draft.long()
    if impl is reference:
        return reference.greedy(logits, drafts, ell, R * W, W, grid=True)
    return impl.greedy(logits, drafts, ell, R * W, W, cu=impl.grid_ends(ell, W))
