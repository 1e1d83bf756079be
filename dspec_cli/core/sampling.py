"""Logits to probabilities (temperature, top-k, top-p) and per-request randomness.

Randomness comes in two flavours:

* counter-based (:func:`uniform`, :func:`exponential`): a pure function of
  (seed, offset, salt[, token]) built from 32-bit integer hashing on int64 tensors, so a
  request's numbers never depend on which other requests share its batch;
* :class:`torch.Generator`-based (:func:`torch_uniform`, :func:`torch_exponential`) for callers
  that just want seeded torch randomness.

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. draws
token ``v`` with probability ``probs[v] / Σ probs``, so unnormalised weights need no division.
Where one sample per row is all that is needed and V hashed numbers per row are too many (the
drafters' sequential loops), :func:`sample_inverse_cdf` takes one uniform per row instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dspec_cli.core.host import reads_free

__all__ = [
    "CounterNoise",
    "exponential",
    "logits_to_probs",
    "sample_from_probs",
    "sample_inverse_cdf",
    "sample_without_replacement",
    "torch_exponential",
    "torch_uniform",
    "uniform",
]

# -- the random streams: every draw is keyed by (request seed, offset, salt) -------------
# Verification (runtime/verify): chain acceptance coin of draft k at (seed, offset + k); the
# final token's Exp(1) noise at (seed, offset) (tree "match": offset + depth); tree "recursive"
# coin of node i at (seed, offset) with salt NODE_SALT + i (also tree "sampled").
COIN_SALT = 1
NOISE_SALT = 2
NODE_SALT = 1 << 28
# The engine (runtime/engine): a request's first token after prefill, its draft tokens, and its
# chain coins; its final-token noise is the verifier's NOISE_SALT, so a row's token is the same
# whether its round is plain, a chain or a tree, whatever the rest of the batch does.
FIRST_TOKEN_SALT = 11
DRAFT_SALT = 23
# Sampled draft trees (RoundSampler.sample_distinct): draw j of frontier node w at depth d at
# (seed, round base + d) with salt TREE_DRAFT_SALT + 256·w + j.
TREE_DRAFT_SALT = 2 << 28
ENGINE_COIN_SALT = 37
ROUND_STRIDE = 4096  # offsets per request round: round * stride + position

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # odd multiplier (2^32 / golden ratio) spreading absorbed words
_LANE_IV = (0x243F6A88, 0x85A308D3)  # distinct start states of the two hash lanes
_TWO_M52 = 2.0**-52
_TWO_M23 = 2.0**-23


# --------------------------------------------------------------------------------------
# Temperature, top-k, top-p
# --------------------------------------------------------------------------------------


def _row_param(value, n: int, device, dtype) -> torch.Tensor:
    """A scalar or [N] parameter as a [N, 1] tensor."""
    t = torch.as_tensor(value, device=device, dtype=dtype)
    if t.dim() == 0:
        return t.expand(n, 1)
    if t.shape != (n,):
        raise ValueError(f"expected a scalar or a tensor of shape [{n}], got {tuple(t.shape)}")
    return t.reshape(n, 1)


def _is_scalar(value, disabled) -> bool:
    """True when value is a python/0-d scalar equal to the no-op setting."""
    return not (isinstance(value, torch.Tensor) and value.dim() > 0) and float(value) == disabled


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Sampling distribution [N, V] float32 from logits [N, V].

    temperature, top_k, top_p: python scalars or per-row tensors [N]. Rows with temperature 0
    are one-hot on the argmax of the raw logits (greedy; first index on ties). Otherwise
    softmax(logits / T), then top-k (0 = off), then top-p on the top-k distribution (1 = off;
    keeps the smallest set of most likely tokens whose mass reaches top_p), renormalised.
    Ties in the ranking are broken by the lower token id, so the kept set is deterministic.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if not any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in (temperature, top_k, top_p)):
        return _scalar_probs(logits.float(), float(temperature), int(top_k), float(top_p))
    n, dev = logits.shape[0], logits.device
    logits = logits.float()
    temp = _row_param(temperature, n, dev, torch.float32)
    k = _row_param(top_k, n, dev, torch.long)
    p = _row_param(top_p, n, dev, torch.float32)
    if n and bool((temp < 0).any() | (k < 0).any() | (p <= 0).any() | (p > 1).any()):
        raise ValueError(_BAD_PARAMS)
    greedy = temp == 0  # [N, 1]
    probs = torch.softmax(logits / torch.where(greedy, torch.ones_like(temp), temp), dim=-1)
    if not (_is_scalar(top_k, 0) and _is_scalar(top_p, 1.0)):
        probs = _top_k_top_p(probs, k, p)
    return torch.where(greedy, _one_hot_argmax(logits), probs)


_BAD_PARAMS = "logits_to_probs: need temperature >= 0, top_k >= 0 and 0 < top_p <= 1"


def _scalar_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits_to_probs for one setting shared by every row (no per-row tensors, no host sync)."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(_BAD_PARAMS)
    if temperature == 0:
        return _one_hot_argmax(logits)
    probs = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    if top_k == 0 and top_p == 1:
        return probs
    return _top_k_top_p(probs, top_k, top_p)  # python scalars: nothing copied to the device (capturable)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] float32 one-hot on the first argmax of each row of logits [N, V]."""
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def _top_k_top_p(probs: torch.Tensor, k: torch.Tensor | int, top_p: torch.Tensor | float) -> torch.Tensor:
    """Mask probs [N, V] to the top-k then nucleus top_p sets and renormalise; k and top_p are
    per-row tensors [N, 1] or python scalars shared by every row (compared on the device as
    they are: no host-to-device copy, so a captured CUDA graph may run this)."""
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    keep = rank < (torch.where(k > 0, k, vocab) if isinstance(k, torch.Tensor) else k if k > 0 else vocab)
    sorted_p = sorted_p * keep  # [N, V] in sorted order
    mass = sorted_p.cumsum(-1)
    before = mass - sorted_p  # mass of strictly better-ranked tokens
    keep = keep & ((before < top_p * mass[:, -1:]) | (top_p >= 1))
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    return kept / kept.sum(-1, keepdim=True)


# --------------------------------------------------------------------------------------
# Counter-based randomness
# --------------------------------------------------------------------------------------


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x in [0, 2^32) on int64 without overflow (ints or tensors).

    c is used as its signed 32-bit representative (|c| < 2^31), so |x * c| < 2^63, and the
    two's-complement mask gives the residue mod 2^32: one multiply and one and.
    """
    y = x * (c - (1 << 32) if c >= 1 << 31 else c)
    y &= _M32
    return y


def _fmix32(h):
    """Bijective 32-bit avalanche mix (xor-shift / multiply rounds). Updates a tensor ``h`` in place."""
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def _absorb_spread(h, spread):
    """Fold a 32-bit word, spread as ``_mul32(word, _GOLDEN)``, into a 32-bit lane state
    (bijective in each argument)."""
    h = h + spread
    h &= _M32
    return _fmix32(h)


def _lanes(seeds: torch.Tensor, offsets: torch.Tensor, salt) -> torch.Tensor:
    """Two independent 32-bit hash states [2, *shape] of (seed, offset, salt), broadcast together.

    Both lanes run in one tensor. A few keys on a CPU are hashed on the host with the same
    integer functions: a handful of tensor calls instead of about sixty. Nothing is copied from
    the host to the device (a python salt enters as a scalar).
    """
    seeds, offsets = seeds.long(), offsets.long()
    if isinstance(salt, torch.Tensor):
        seeds, offsets, salt = torch.broadcast_tensors(seeds, offsets, salt.to(seeds.device, torch.long))
    else:
        seeds, offsets = torch.broadcast_tensors(seeds, offsets)
        salt = int(salt)
    if _on_host(seeds):
        lanes = [_host_lanes(*key) for key in _host_keys(seeds, offsets, salt)]  # [numel][2]
        return torch.tensor(lanes, dtype=torch.long).view(-1, 2).T.reshape(2, *seeds.shape)
    h = _lane_iv(seeds.device).view((2,) + (1,) * seeds.dim())
    h = _absorb_spread(h, _mul32(salt & _M32, _GOLDEN))
    words = torch.stack([seeds, seeds >> 32, offsets, offsets >> 32]) & _M32  # low / high halves
    for spread in _mul32(words, _GOLDEN):
        h = _absorb_spread(h, spread)
    return h


def _lane_iv(device: torch.device) -> torch.Tensor:
    """The lanes' start states [2] on ``device`` (made once: no host-to-device copy per call)."""
    iv = _DEVICE_CONSTANTS.get(("iv", device))
    if iv is None:
        iv = _DEVICE_CONSTANTS[("iv", device)] = torch.tensor(_LANE_IV, dtype=torch.long, device=device)
    return iv


# tensors made once per device (and vocabulary): a plain dict, which torch.compile reads as constants
_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}

_HOST_KEYS = 16  # keys hashed on the host (per key ~100 integer operations)


def _on_host(seeds: torch.Tensor) -> bool:
    """Hash these keys (broadcast already) on the host: a few, where reading them is free."""
    return seeds.numel() <= _HOST_KEYS and reads_free(seeds)


def _host_keys(seeds: torch.Tensor, offsets: torch.Tensor, salt: torch.Tensor | int):
    """(salt, seed, offset) python ints of every key, row-major (broadcast tensors; a python salt
    is the same for every key)."""
    seed_list, offset_list = seeds.flatten().tolist(), offsets.flatten().tolist()
    salts = [salt] * len(seed_list) if isinstance(salt, int) else salt.flatten().tolist()
    return zip(salts, seed_list, offset_list, strict=True)


def _host_lanes(salt: int, seed: int, offset: int) -> list[int]:
    """The two lane states of one key with python ints (same words, same order as the tensor path)."""
    return [_host_absorb(h, offset & _M32, (offset >> 32) & _M32) for h in _host_prefix(salt, seed)]


@functools.lru_cache(maxsize=4096)
def _host_prefix(salt: int, seed: int) -> tuple[int, ...]:
    """Lane states after (salt, seed low, seed high): shared by every offset of a request."""
    return tuple(_host_absorb(h, salt & _M32, seed & _M32, (seed >> 32) & _M32) for h in _LANE_IV)


def _host_absorb(h: int, *words: int) -> int:
    """h with each 32-bit word absorbed in turn: :func:`_absorb_spread` of ``_mul32(word,
    _GOLDEN)`` written out on python ints (unsigned constants give the same residues mod 2^32;
    no calls per word keeps the host path a few µs per key)."""
    for w in words:
        h = (h + w * _GOLDEN) & _M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _M32
        h ^= h >> 16
    return h


def uniform(seeds: torch.Tensor, offsets: torch.Tensor, salt: int | torch.Tensor = 0) -> torch.Tensor:
    """Counter-based uniforms: float64 in the open interval (0, 1).

    seeds [...] and offsets [...]: int64 tensors broadcast together (e.g. [R] and [R], or
    [R, 1] and [R, L]);
    salt: an int, or an int tensor [...] broadcast with them, separating streams. A pure function of (seed, offset, salt) with
    52 random bits; never 0 and never 1.
    """
    if seeds.numel() == 0 or offsets.numel() == 0:
        return torch.empty(torch.broadcast_shapes(seeds.shape, offsets.shape), dtype=torch.float64, device=seeds.device)
    if max(seeds.numel(), offsets.numel()) <= _HOST_KEYS and reads_free(seeds):
        salt = torch.as_tensor(salt, dtype=torch.long)
        keys = torch.broadcast_tensors(seeds.long(), offsets.long(), salt)
        if _on_host(keys[0]):  # the same numbers as below, as python floats (exact in float64)
            lanes = (_host_lanes(*key) for key in _host_keys(*keys))
            values = [(((a << 20) | (b >> 12)) + 0.5) * _TWO_M52 for a, b in lanes]
            return torch.tensor(values, dtype=torch.float64).view(keys[0].shape)
    a, b = _lanes(seeds, offsets, salt)
    bits = (a << 20) | (b >> 12)  # 52 bits
    return (bits.double() + 0.5) * _TWO_M52


def exponential(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int, salt=0) -> torch.Tensor:
    """Counter-based Exp(1) noise [N, vocab] float32, keyed by (seed, offset, salt, token id).

    seeds, offsets: [N] int64. Uses 23 random bits per entry; every value is finite and > 0.
    """
    state = _lanes(seeds.reshape(-1, 1), offsets.reshape(-1, 1), salt)[0]  # [N, 1]
    h = _absorb_spread(state, _token_words(vocab, state.device))  # [N, V]
    u = (h >> 9).float().add_(0.5).mul_(_TWO_M23)  # (0, 1), exact in float32
    return u.log_().neg_()


@dataclass(frozen=True)
class CounterNoise:
    """The noise ``exponential(seeds, offsets, V, salt)`` named by its keys: a vocabulary-wide
    noise tensor that kernels can compute where they use it instead of reading it."""

    seeds: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [N] int64
    salt: int

    def tensor(self, vocab: int) -> torch.Tensor:
        """The noise itself, [N, vocab] float32."""
        return exponential(self.seeds, self.offsets, vocab, self.salt)


def _token_words(vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids [V] spread for :func:`_absorb_spread` (cached per vocabulary and device)."""
    words = _DEVICE_CONSTANTS.get((vocab, device))
    if words is None:
        words = _DEVICE_CONSTANTS[(vocab, device)] = _mul32(torch.arange(vocab, device=device, dtype=torch.long), _GOLDEN)
    return words


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(probs / noise) [N] for unnormalised probs [N, V], noise [N, V] > 0."""
    return (probs / noise).argmax(-1)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token [N] with P(v) = probs[v] / Σ probs from unnormalised probs [N, V] and one uniform
    u [N] in (0, 1) per row: the first v whose cumulative weight reaches u·Σ probs (float64
    cumulative sums; a zero-weight token is never chosen)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    where = (u.double() * cdf[:, -1])[:, None]  # [N, 1]
    return torch.searchsorted(cdf, where).squeeze(1).clamp(max=probs.shape[-1] - 1)


def sample_without_replacement(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """n successive draws without replacement [N, n] from unnormalised weights [N, V], draw j by
    the inverse CDF with uniform u [N, n] (float64 in (0, 1)) over the weights with the earlier
    draws removed: the first v whose remaining cumulative weight reaches u_j × the remaining
    total. One float64 cumulative sum serves every draw: removing tokens lowers the cumulative
    weight at v by the removed weight at or below v, c(v), so draw j is the fixed point of
    v ← searchsorted(cdf, target + c(v)), reached from c = 0 in at most j steps (c only grows,
    one removed token at a time). Zero-weight tokens are never drawn while weight remains."""
    N, V = weights.shape
    n = u.shape[1]
    w = weights.double()
    cdf = w.cumsum(-1)  # [N, V]
    remaining = cdf[:, -1].clone()  # [N]
    drawn = torch.zeros(N, n, dtype=torch.long, device=weights.device)
    taken = torch.zeros(N, n, dtype=torch.float64, device=weights.device)  # weight of each draw
    for j in range(n):
        target = (u[:, j].double() * remaining)[:, None]  # [N, 1]
        x = torch.searchsorted(cdf, target).clamp(max=V - 1)  # [N, 1]
        for _ in range(j):
            below = (taken[:, :j] * (drawn[:, :j] <= x)).sum(1, keepdim=True)  # c(x) [N, 1]
            nxt = torch.searchsorted(cdf, target + below).clamp(max=V - 1)
            if reads_free(nxt) and torch.equal(nxt, x):  # converged (a free read on a CPU)
                break
            x = nxt
        drawn[:, j : j + 1] = x
        taken[:, j : j + 1] = w.gather(1, x)
        remaining = remaining - taken[:, j]
    return drawn


# --------------------------------------------------------------------------------------
# torch.Generator randomness
# --------------------------------------------------------------------------------------


def torch_uniform(shape, *, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Seeded torch uniforms, float64 in (0, 1) (0 is replaced by 2^-53), on `device`.

    Drawn on the generator's device (so a CPU generator gives the same numbers everywhere).
    """
    src = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=src, dtype=torch.float64)
    return u.clamp_(min=2.0**-53).to(device if device is not None else u.device)


def torch_exponential(shape, *, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Seeded Exp(1) noise, float32, finite and > 0 (-log of :func:`torch_uniform`)."""
    return (-torch.log(torch_uniform(shape, generator=generator, device=device))).float()
