"""Input validation for the verifiers.

Shape, dtype and device checks run on the host. Value checks (lengths, token ranges, probability
rows, randomness ranges) are reduced on the device into one small tensor and read back with a
single synchronisation; the first failing check raises ValueError naming its argument.
"""

from __future__ import annotations

import torch

SUM_TOL = 1e-3  # tolerance on probability row sums (widened to the dtype's eps, e.g. bfloat16)


def _fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def tensor(name: str, x, *, dim: int, kind: str, device: torch.device | None = None) -> torch.Tensor:
    """Host-side check of one tensor argument; kind is "int" or "float"."""
    if not isinstance(x, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        _fail(name, f"expected a {dim}-D tensor, got shape {tuple(x.shape)}")
    if kind == "int" and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        _fail(name, f"expected an integer dtype, got {x.dtype}")
    if kind == "float" and not x.dtype.is_floating_point:
        _fail(name, f"expected a floating dtype, got {x.dtype}")
    if device is not None and x.device != device:
        _fail(name, f"is on {x.device} but the other inputs are on {device}")
    return x


def positive(name: str, value: float) -> None:
    """Host-side check of a scalar setting: finite and > 0."""
    if not 0 < value < float("inf"):
        _fail(name, f"must be finite and > 0, got {value}")


def shape(name: str, x: torch.Tensor, expected: tuple) -> None:  # x [...] of any shape
    """Exact shape check (entries of None are free)."""
    if len(x.shape) != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected, strict=True)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        _fail(name, f"expected shape [{want}], got {list(x.shape)}")


def rng_keys(seeds, offsets, R: int, device: torch.device) -> None:
    """Counter-based randomness keys: both or neither, [R] integer tensors on device."""
    if (seeds is None) != (offsets is None):
        _fail("seeds", "seeds and offsets must be given together")
    if seeds is not None:
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            tensor(name, t, dim=1, kind="int", device=device)
            shape(name, t, (R,))


class Checks:
    """Collects device-side 0-d checks and evaluates them with one host sync.

    ``stat(t)`` records a value to read back; ``require(name, ok, message)`` a boolean
    condition. ``run()`` syncs once, raises on the first failed condition (in insertion order)
    and returns the recorded stats as python numbers.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._values: list[torch.Tensor] = []
        self._conds: list[tuple[int, str, str]] = []

    def _push(self, t) -> int:
        self._values.append(torch.as_tensor(t, device=self.device).reshape(()).double())
        return len(self._values) - 1

    def stat(self, t) -> int:
        return self._push(t)

    def require(self, name: str, ok, message: str) -> None:
        self._conds.append((self._push(ok), name, message))

    def run(self) -> list[float]:
        values = torch.stack(self._values).tolist() if self._values else []
        for i, name, message in self._conds:
            if not values[i]:
                _fail(name, message)
        return values


def lengths(checks: Checks, name: str, num: torch.Tensor, validate: bool) -> tuple[int, int]:  # num [R]
    """Record Σ and max of a lengths vector [R] (and its non-negativity); indices into stats."""
    if validate:
        checks.require(name, (num >= 0).all() if num.numel() else True, "lengths must be >= 0")
    total = checks.stat(num.sum())
    longest = checks.stat(num.max() if num.numel() else 0)
    return total, longest


def prob_rows(checks: Checks, name: str, probs: torch.Tensor) -> None:  # probs [M, V]
    """Rows [M, V] must be finite, non-negative and sum to 1 (within SUM_TOL or the dtype's eps)."""
    if probs.numel() == 0:
        return
    tol = max(SUM_TOL, torch.finfo(probs.dtype).eps)
    sums = probs.sum(-1, dtype=torch.float32)  # NaN/inf entries make the sum non-finite
    checks.require(name, ((sums - 1).abs() <= tol).all(), f"rows must be finite and sum to 1 (tol {tol:.2g})")
    checks.require(name, probs.amin() >= 0, "probabilities must be >= 0")


def token_range(checks: Checks, name: str, tokens: torch.Tensor, vocab: int) -> None:  # tokens [...]
    if tokens.numel():
        checks.require(name, ((tokens >= 0) & (tokens < vocab)).all(), f"token ids must lie in [0, {vocab})")


def open_unit(checks: Checks, name: str, u: torch.Tensor) -> None:  # u [...]
    if u.numel():
        checks.require(name, ((u > 0) & (u < 1)).all(), "values must lie in the open interval (0, 1)")


def positive_finite(checks: Checks, name: str, x: torch.Tensor) -> None:  # x [...]
    if x.numel():
        checks.require(name, ((x > 0) & torch.isfinite(x)).all(), "values must be finite and > 0")


def no_nan(checks: Checks, name: str, x: torch.Tensor) -> None:  # x [...]
    if x.numel():
        checks.require(name, ~torch.isnan(x).any(), "contains NaN")
