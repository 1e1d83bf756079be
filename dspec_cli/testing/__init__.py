"""Statistical harness for losslessness tests (docs/verification.md).

Three layers, each usable on its own:

* Goodness of fit: :func:`chi_square_gof`, :func:`gof_test`, :func:`assert_same_distribution`
  compare samples (single tokens or tuples of tokens) with exact probabilities. scipy is used
  for the chi-square tail when importable; otherwise an exact regularized-gamma fallback.
* Toy models: :class:`ToyLM` is a first-order Markov chain over a small vocabulary whose
  next-token distribution goes through :func:`dspec_cli.core.sampling.logits_to_probs`, so its exact
  joint distribution is cheap (:func:`exact_target_joint`). :class:`ToyDrafter` proposes γ
  tokens autoregressively from another chain, with q and non-anticipating confidences.
* Simulation: :func:`simulate_speculative` and :func:`simulate_tree_speculative` run many
  independent requests through multi-round speculative decoding at once (Python loops over
  rounds and draft positions only) and return the committed tokens, to compare with :func:`sample_target`.

Typical use::

    tokens = simulate_speculative(target, drafter, num_requests=200_000, gamma=3, num_tokens=2,
                                  x0=0, generator=torch.Generator().manual_seed(0))
    assert_same_distribution(tokens, exact_target_joint(target, 0, 2), name="first two tokens")

A length policy is the scheduler hook: it sees a :class:`~dspec_cli.runtime.drafter.Proposal` (tokens,
draft probs, confidences) and returns ℓ_r ∈ [0, γ]. :func:`throughput_length_policy` gives the
causal early-stop scheduler and the retrospective global search of the paper's Appendix A
(:func:`appendix_a` builds that setting: the retrospective one yields (0.85, 0.15) instead of
the target's (0.7, 0.3)).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspec_cli.core.sampling import logits_to_probs
from dspec_cli.core.types import DraftTree, Proposal, VerifyResult
from dspec_cli.runtime.drafter import heuristic_confidence
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.verify import verify_chain, verify_tree
from dspec_cli.runtime.verify.tree import SAMPLED_METHODS

LengthPolicy = Callable[[Proposal], torch.Tensor]

# --------------------------------------------------------------------------------------
# Goodness of fit
# --------------------------------------------------------------------------------------


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series below a+1, continued fraction above)."""
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # P(a, x) = e^{-x} x^a / Γ(a) · Σ_n x^n / (a(a+1)…(a+n))
        term = total = 1.0 / a
        denom = a
        for _ in range(100_000):
            denom += 1.0
            term *= x / denom
            total += term
            if term < total * 1e-17:
                break
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_front)))
    tiny = 1e-300  # modified Lentz evaluation of the continued fraction for Q
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_sf(statistic: float, dof: int, *, method: str = "auto") -> float:
    """P(χ²_dof ≥ statistic). method: "auto" (scipy if importable), "scipy" or "gamma"."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if method not in ("auto", "scipy", "gamma"):
        raise ValueError(f"method must be 'auto', 'scipy' or 'gamma', got {method!r}")
    if math.isinf(statistic):
        return 0.0
    if method != "gamma":
        try:
            from scipy.stats import chi2
        except ImportError:
            if method == "scipy":
                raise
        else:
            return float(chi2.sf(statistic, dof))
    return _gamma_q(dof / 2.0, statistic / 2.0)


def _as_float64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    return arr


def _pool_low_bins(obs: np.ndarray, exp: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge the smallest-expectation bins into one bin until every bin expects >= min_expected."""
    order = np.argsort(exp, kind="stable")
    csum = np.cumsum(exp[order])
    k = int((exp < min_expected).sum())
    if k == 0:
        return obs, exp
    k = min(len(exp), max(k, int(np.searchsorted(csum, min_expected)) + 1))
    rest = order[k:]
    return np.append(obs[rest], obs[order[:k]].sum()), np.append(exp[rest], csum[k - 1])


def chi_square_gof(observed_counts, expected_probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of counts [K] against probabilities [K].

    Bins expecting fewer than ``min_expected`` samples are pooled into one bin. Any count in a
    zero-probability bin is an immediate failure: (inf, dof, 0.0). Returns (statistic, dof,
    p_value); a single (pooled) bin gives (0.0, 0, 1.0).
    """
    obs = _as_float64(observed_counts, "observed_counts")
    probs = _as_float64(expected_probs, "expected_probs")
    if obs.shape != probs.shape:
        raise ValueError(f"observed_counts has {obs.size} bins but expected_probs has {probs.size}")
    total = probs.sum()
    if abs(total - 1.0) > 1e-4:
        raise ValueError(f"expected_probs must sum to 1, got {total:.6g}")
    n = obs.sum()
    if n <= 0:
        raise ValueError("observed_counts must hold at least one sample")
    support = probs > 0
    dof = max(int(support.sum()) - 1, 0)
    if np.any(obs[~support] > 0):
        return math.inf, dof, 0.0
    obs, exp = _pool_low_bins(obs[support], n * probs[support] / total, min_expected)
    dof = len(obs) - 1
    if dof == 0:
        return 0.0, 0, 1.0
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return statistic, dof, chi2_sf(statistic, dof)


@dataclass(frozen=True)
class GofResult:
    """Outcome of :func:`gof_test`; :meth:`describe` renders it with the most deviating bins."""

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    counts: np.ndarray  # [K] observed counts (flattened bins)
    probs: np.ndarray  # [K] expected probabilities
    shape: tuple[int, ...]  # shape of the expected table; bins of a joint print as tuples

    def worst_bins(self, k: int = 5) -> list[tuple[tuple[int, ...] | int, float, float, float]]:
        """The k bins with the largest |standardised residual|: (bin, observed freq, expected p, z)."""
        exp = self.num_samples * self.probs
        z = np.where(self.counts > 0, np.inf, 0.0)  # zero-probability bins
        pos = exp > 0
        z[pos] = (self.counts[pos] - exp[pos]) / np.sqrt(exp[pos])
        out = []
        for i in np.argsort(-np.abs(z), kind="stable")[:k]:
            label = tuple(int(j) for j in np.unravel_index(i, self.shape)) if len(self.shape) > 1 else int(i)
            out.append((label, self.counts[i] / self.num_samples, float(self.probs[i]), float(z[i])))
        return out

    def describe(self, name: str = "samples") -> str:
        lines = [
            f"{name}: chi-square = {self.statistic:.4g}, dof = {self.dof}, p = {self.p_value:.3g} "
            f"(n = {self.num_samples})",
            "  bin: observed freq vs expected prob (z)",
        ]
        lines += [f"  {b}: {o:.5f} vs {e:.5f} (z = {z:+.1f})" for b, o, e, z in self.worst_bins()]
        return "\n".join(lines)


def joint_index(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row-major flat index of token tuples: tokens [N, k] -> [N] in [0, V^k)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [N, k], got shape {tuple(tokens.shape)}")
    weights = vocab_size ** torch.arange(tokens.shape[1] - 1, -1, -1, device=tokens.device)
    return (tokens.long() * weights).sum(1)


def gof_test(samples: torch.Tensor, expected_probs, *, min_expected: float = 5.0) -> GofResult:
    """Chi-square test of samples against exact probabilities.

    expected_probs has shape [K] or, for joints of k tokens, [V]*k. samples is [N] (flat bin
    indices) or [N, k] token tuples when expected_probs has k dimensions. Samples outside the
    table (e.g. -1 padding) fail the test with p = 0.
    """
    expected = torch.as_tensor(expected_probs, dtype=torch.float64).cpu()
    samples = torch.as_tensor(samples).cpu().long()
    shape = tuple(expected.shape)
    if samples.dim() == 2:
        if samples.shape[1] != len(shape) or len(set(shape)) != 1:
            raise ValueError(f"samples of shape {tuple(samples.shape)} do not match expected_probs {shape}")
        bad = ((samples < 0) | (samples >= shape[0])).any(1)
        flat = joint_index(samples.clamp(0, shape[0] - 1), shape[0])
    elif samples.dim() == 1:
        bad = (samples < 0) | (samples >= expected.numel())
        flat = samples
    else:
        raise ValueError(f"samples must be [N] or [N, k], got shape {tuple(samples.shape)}")
    probs = expected.reshape(-1).numpy()
    counts = torch.bincount(flat[~bad], minlength=probs.size).double().numpy()
    n = int(samples.shape[0])
    if bad.any():
        statistic, dof, p = math.inf, int((probs > 0).sum()) - 1, 0.0
    else:
        statistic, dof, p = chi_square_gof(counts, probs, min_expected)
    return GofResult(statistic, dof, p, n, counts, probs / probs.sum(), shape)


def assert_same_distribution(
    samples: torch.Tensor,
    expected_probs,
    *,
    alpha: float = 1e-4,
    name: str = "samples",
    min_expected: float = 5.0,
) -> GofResult:
    """Raise AssertionError (statistic, dof, p, worst bins) unless the samples fit at level alpha."""
    result = gof_test(samples, expected_probs, min_expected=min_expected)
    if result.p_value < alpha:
        raise AssertionError(f"distribution mismatch (alpha = {alpha:g})\n" + result.describe(name))
    return result


# --------------------------------------------------------------------------------------
# Toy language models
# --------------------------------------------------------------------------------------


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row by inverse CDF: probs [N, V] (unnormalised is fine) -> [N] long.

    Independent of the verifier's exponential-race sampler; zero-probability tokens are never drawn.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64).clamp_(min=2.0**-60)
    return (cdf < u * cdf[:, -1:]).sum(-1)


@dataclass(frozen=True)
class ToyLM:
    """First-order Markov chain LM: next-token logits depend only on the previous token.

    The sampling settings are part of the model: ``probs`` is the distribution a lossless
    decoder must reproduce.
    """

    transition_logits: torch.Tensor  # [V, V]; row = previous token
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.transition_logits
        if t.dim() != 2 or t.shape[0] != t.shape[1]:
            raise ValueError(f"transition_logits must be [V, V], got shape {tuple(t.shape)}")

    @classmethod
    def random(cls, vocab_size: int, *, scale: float = 2.0, generator: torch.Generator, **sampling) -> ToyLM:
        """Gaussian logits with standard deviation ``scale`` (larger = more peaked)."""
        return cls(scale * torch.randn(vocab_size, vocab_size, generator=generator), **sampling)

    @classmethod
    def iid(cls, logits: torch.Tensor, **sampling) -> ToyLM:
        """Every position has the same next-token logits [V] (an i.i.d. source)."""
        return cls(logits.float().expand(logits.shape[-1], -1).clone(), **sampling)

    @classmethod
    def from_probs(cls, probs: torch.Tensor, **sampling) -> ToyLM:
        """i.i.d. source ([V]) or chain ([V, V]) with the given probabilities (zeros stay zero)."""
        logits = probs.double().log().float()
        return cls.iid(logits, **sampling) if logits.dim() == 1 else cls(logits, **sampling)

    @property
    def vocab_size(self) -> int:
        return self.transition_logits.shape[0]

    def with_sampling(self, **sampling) -> ToyLM:
        """Same chain, other temperature / top_k / top_p."""
        return dataclasses.replace(self, **sampling)

    def probs(
        self,
        prev_tokens: torch.Tensor,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> torch.Tensor:
        """Next-token probabilities [N, V] after prev_tokens [N]; None = the model's settings."""
        table = logits_to_probs(
            self.transition_logits,
            self.temperature if temperature is None else temperature,
            self.top_k if top_k is None else top_k,
            self.top_p if top_p is None else top_p,
        )
        return table[prev_tokens]


@dataclass(frozen=True)
class ToyDrafter:
    """Autoregressive drafter over a :class:`ToyLM`.

    greedy=True proposes the argmax and no draft probs (one-hot verification). Confidences
    are non-anticipating: c_k = confidence_table[x_{k-1}] (a Markov confidence head; x_0 is
    the anchor) or, without a table, the Σq² heuristic of q_k's shape.
    """

    model: ToyLM
    greedy: bool = False
    confidence_table: torch.Tensor | None = None  # [V]

    def propose(self, anchors: torch.Tensor, gamma: int, generator: torch.Generator | None) -> Proposal:
        """γ draft tokens after each anchor [R]."""
        prev = anchors
        tokens, probs, conf = [], [], []
        for _ in range(gamma):
            q = self.model.probs(prev)  # [R, V]
            x = q.argmax(-1) if self.greedy else sample_categorical(q, generator)
            if self.confidence_table is not None:
                conf.append(self.confidence_table[prev])
            tokens.append(x)
            probs.append(q)
            prev = x
        q_all = torch.stack(probs, 1)  # [R, γ, V]
        lengths = torch.full_like(anchors, gamma)
        confidence = (
            torch.stack(conf, 1).float()
            if self.confidence_table is not None
            else heuristic_confidence(q_all, lengths, gamma)
        )
        return Proposal(
            tokens=torch.stack(tokens, 1),
            lengths=lengths,
            draft_probs=None if self.greedy else q_all,
            confidence=confidence,
        )


# --------------------------------------------------------------------------------------
# Exact references
# --------------------------------------------------------------------------------------


def exact_target_joint(target: ToyLM, x0: int, num_tokens: int) -> torch.Tensor:
    """Exact joint of the first num_tokens tokens after x0: float64 tensor of shape [V]*num_tokens."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    table = target.probs(torch.arange(target.vocab_size)).double()  # [V, V]
    joint = table[x0]
    for _ in range(num_tokens - 1):
        joint = joint.unsqueeze(-1) * table  # [..., t_{k-1}, t_k]
    return joint


def _anchors(x0: int | torch.Tensor, num_requests: int) -> torch.Tensor:
    if isinstance(x0, torch.Tensor):
        if x0.shape != (num_requests,):
            raise ValueError(f"x0 must be an int or [num_requests], got shape {tuple(x0.shape)}")
        return x0.long().clone()
    return torch.full((num_requests,), int(x0), dtype=torch.long)


def _run_rounds(
    num_requests: int,
    num_tokens: int,
    x0: int | torch.Tensor,
    step: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Run rounds until every request has num_tokens tokens.

    step(last [Ra]) -> (tokens [Ra, L] padded, count [Ra] >= 1) for the still-active requests.
    """
    if num_requests < 1 or num_tokens < 1:
        raise ValueError(f"num_requests and num_tokens must be >= 1, got {num_requests}, {num_tokens}")
    out = torch.full((num_requests, num_tokens), -1, dtype=torch.long)
    done = torch.zeros(num_requests, dtype=torch.long)
    last = _anchors(x0, num_requests)
    for _ in range(num_tokens):  # every round commits >= 1 token per request
        active = (done < num_tokens).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        tokens, count = step(last[active])
        if bool((count < 1).any()):
            raise AssertionError("a round committed no token for some request")
        cols = torch.arange(tokens.shape[1])
        pos = done[active, None] + cols  # [Ra, L]
        keep = (cols < count[:, None]) & (pos < num_tokens)
        out[active[:, None].expand_as(pos)[keep], pos[keep]] = tokens[keep]
        done[active] += count
        last[active] = tokens.gather(1, (count - 1)[:, None]).squeeze(1)
    return out


def sample_target(
    target: ToyLM, *, num_requests: int, num_tokens: int, x0: int | torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Plain autoregressive sampling from the target: [num_requests, num_tokens]."""

    def step(last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = sample_categorical(target.probs(last), generator)
        return x[:, None], torch.ones_like(x)

    return _run_rounds(num_requests, num_tokens, x0, step)


def greedy_target(target: ToyLM, *, num_tokens: int, x0: int | torch.Tensor, num_requests: int = 1) -> torch.Tensor:
    """Greedy decoding (argmax of the raw logits): [num_requests, num_tokens]."""
    best = target.transition_logits.argmax(-1)  # [V]

    def step(last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return best[last][:, None], torch.ones_like(last)

    return _run_rounds(num_requests, num_tokens, x0, step)


# --------------------------------------------------------------------------------------
# Structural checks of verifier output
# --------------------------------------------------------------------------------------


def check_chain_result(result: VerifyResult, drafts: torch.Tensor, num_draft: torch.Tensor, vocab_size: int) -> None:
    """Invariants of a chain verification: drafts [R, γ], num_draft [R]. Raises AssertionError."""
    acc, tokens, n = result.accepted, result.tokens, result.num_tokens
    R = drafts.shape[0]
    if acc.shape != (R,) or n.shape != (R,) or tokens.dim() != 2 or tokens.shape[0] != R:
        raise AssertionError(f"bad VerifyResult shapes: {acc.shape}, {tokens.shape}, {n.shape} for R = {R}")
    if bool(((acc < 0) | (acc > num_draft)).any()) or not torch.equal(n, acc + 1):
        raise AssertionError("accepted must lie in [0, num_draft] and num_tokens must equal accepted + 1")
    if tokens.shape[1] < int(n.max()):
        raise AssertionError(f"tokens has {tokens.shape[1]} columns, fewer than max num_tokens {int(n.max())}")
    cols = torch.arange(tokens.shape[1])
    padded = torch.cat([drafts, drafts.new_zeros(R, max(tokens.shape[1] - drafts.shape[1], 0))], 1)
    if bool(((tokens != padded[:, : tokens.shape[1]]) & (cols < acc[:, None])).any()):
        raise AssertionError("accepted tokens differ from the drafts")
    _check_padding(tokens, n, vocab_size)


def check_tree_result(result: VerifyResult, tree: DraftTree, vocab_size: int) -> None:
    """Invariants of a tree verification: the accepted tokens spell a root-to-node path."""
    acc, tokens, n, path = result.accepted, result.tokens, result.num_tokens, result.path
    if path is None:
        raise AssertionError("tree verification must return the accepted path")
    if not torch.equal(n, acc + 1):
        raise AssertionError("num_tokens must equal accepted + 1")
    _check_padding(tokens, n, vocab_size)
    if not bool((path[:, 0] == 0).all()):
        raise AssertionError("path must start at the root (node 0)")
    R = tokens.shape[0]
    node_tok = torch.cat([torch.full((R, 1), -1), tree.tokens], 1)  # [R, N+1]; node 0 = root
    node_par = torch.cat([torch.zeros(R, 1, dtype=torch.long), tree.parents], 1)
    depth = int(acc.max()) if R else 0
    for d in range(depth):  # path[:, 0] is the root; path[:, d+1] the d-th accepted node
        live = d < acc
        node = path[live, d + 1]
        if bool(((node < 1) | (node > tree.num_nodes[live])).any()):
            raise AssertionError(f"path position {d + 1} names a node outside the tree")
        rows = live.nonzero().squeeze(1)
        if not torch.equal(node_par[rows, node], path[live, d]):
            raise AssertionError(f"path position {d + 1} is not a child of the previous node")
        if not torch.equal(node_tok[rows, node], tokens[live, d]):
            raise AssertionError(f"token {d} differs from the token of its path node")


def _check_padding(tokens: torch.Tensor, n: torch.Tensor, vocab_size: int) -> None:
    valid = torch.arange(tokens.shape[1]) < n[:, None]  # [R, W]
    if bool((valid & ((tokens < 0) | (tokens >= vocab_size))).any()):
        raise AssertionError("a committed token lies outside the vocabulary")
    if bool((~valid & (tokens != -1)).any()):
        raise AssertionError("tokens past num_tokens must be padded with -1")


# --------------------------------------------------------------------------------------
# Speculative decoding simulations
# --------------------------------------------------------------------------------------


def simulate_speculative(
    target: ToyLM,
    drafter: ToyDrafter,
    *,
    num_requests: int,
    gamma: int,
    num_tokens: int,
    x0: int | torch.Tensor = 0,
    verifier: Callable[..., VerifyResult] = verify_chain,
    length_policy: LengthPolicy | None = None,
    generator: torch.Generator,
    **verify_kwargs,
) -> torch.Tensor:
    """Chain speculative decoding of many independent requests: [num_requests, num_tokens].

    Each round: the drafter proposes γ tokens, ``length_policy`` (default: all γ) picks ℓ_r,
    the target scores the ragged prefixes, ``verifier`` (verify_chain's signature) accepts, and
    the accepted tokens plus the correction/bonus token are committed.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")

    def step(last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prop = drafter.propose(last, gamma, generator)
        ell = prop.lengths if length_policy is None else length_policy(prop)
        if ell.shape != last.shape or bool(((ell < 0) | (ell > gamma)).any()):
            raise AssertionError(f"length_policy must return [R] lengths in [0, {gamma}]")
        ell = ell.long()
        draft_mask = torch.arange(gamma) < ell[:, None]  # [Ra, γ]
        context = torch.cat([last[:, None], prop.tokens], 1)  # [Ra, γ+1]
        target_probs = target.probs(context[torch.arange(gamma + 1) <= ell[:, None]])  # [Σ(ℓ+1), V]
        draft_probs = None if prop.draft_probs is None else prop.draft_probs[draft_mask]  # [Σℓ, V]
        res = verifier(target_probs, prop.tokens[draft_mask], draft_probs, ell, generator=generator, **verify_kwargs)
        check_chain_result(res, prop.tokens, ell, target.vocab_size)
        return res.tokens, res.num_tokens

    return _run_rounds(num_requests, num_tokens, x0, step)


def random_tree(
    drafter: ToyDrafter,
    anchors: torch.Tensor,
    *,
    depth: int,
    branching: int,
    generator: torch.Generator,
    ragged: bool = True,
) -> DraftTree:
    """A draft tree per anchor [R] from the drafter's chain.

    Full ``branching``-ary tree of ``depth`` levels in breadth-first order; each node's
    children are distinct tokens drawn without replacement from q (Gumbel top-k). With
    ragged=True request r keeps a random breadth-first prefix of N_r ∈ [0, N] nodes.
    """
    if depth < 1 or not 1 <= branching <= drafter.model.vocab_size:
        raise ValueError(f"need depth >= 1 and 1 <= branching <= V, got {depth}, {branching}")
    R = anchors.shape[0]
    level_tokens, tokens, parents = anchors[:, None], [], []
    first_id = 0  # node id of the first node of the parent level (the root is node 0)
    for _ in range(depth):
        width = level_tokens.shape[1]
        q = drafter.model.probs(level_tokens.reshape(-1))  # [R·width, V]
        u = torch.rand(q.shape, generator=generator).clamp_min(1e-20)
        children = (q.log() - (-u.log()).log()).topk(branching, -1).indices  # [R·width, b]
        level_tokens = children.reshape(R, width * branching)
        tokens.append(level_tokens)
        parents.append((first_id + torch.arange(width)).repeat_interleave(branching).expand(R, -1))
        first_id += width
    tokens_t, parents_t = torch.cat(tokens, 1), torch.cat(parents, 1)  # [R, N]
    N = tokens_t.shape[1]
    if ragged:
        num_nodes = torch.randint(0, N + 1, (R,), generator=generator)
    else:
        num_nodes = torch.full((R,), N, dtype=torch.long)
    pad = torch.arange(N) >= num_nodes[:, None]
    return DraftTree(tokens=tokens_t.masked_fill(pad, -1), parents=parents_t.masked_fill(pad, 0), num_nodes=num_nodes)


def simulate_tree_speculative(
    target: ToyLM,
    drafter: ToyDrafter,
    *,
    num_requests: int,
    depth: int,
    branching: int,
    num_tokens: int,
    x0: int | torch.Tensor = 0,
    method: str = "match",
    generator: torch.Generator,
    tree_policy: Callable[[DraftTree], DraftTree] | None = None,
    **verify_kwargs,
) -> torch.Tensor:
    """Tree speculative decoding (:func:`random_tree` + verify_tree): [num_requests, num_tokens].

    With ``method="sampled"`` or ``"traversal"`` the drafter's q of every row (the distribution its
    children were drawn from) is passed as ``draft_probs``. ``tree_policy`` (the tree analogue of
    a length policy) maps each drafted tree, with ``draft_probs`` [R, N+1, V] set and padded
    parents -1, to the tree that is verified (e.g. a budget that cuts it)."""

    def step(last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tree = random_tree(drafter, last, depth=depth, branching=branching, generator=generator)
        if tree_policy is not None:
            context = torch.cat([last[:, None], tree.tokens.clamp(min=0)], 1)
            pad = torch.arange(tree.tokens.shape[1]) >= tree.num_nodes[:, None]
            tree = tree_policy(dataclasses.replace(tree, parents=tree.parents.masked_fill(pad, -1),
                                                   draft_probs=drafter.model.probs(context.flatten()).view(*context.shape, -1)))
        N = tree.tokens.shape[1]
        node_mask = torch.arange(N) < tree.num_nodes[:, None]  # [Ra, N]
        row_mask = torch.cat([torch.ones_like(node_mask[:, :1]), node_mask], 1)  # [Ra, N+1]
        context = torch.cat([last[:, None], tree.tokens], 1)
        target_probs = target.probs(context[row_mask])  # [Σ(N_r+1), V]
        extra = dict(verify_kwargs)
        if method in SAMPLED_METHODS:
            extra["draft_probs"] = drafter.model.probs(context[row_mask])
        res = verify_tree(
            target_probs,
            tree.tokens[node_mask],
            tree.parents[node_mask],
            tree.num_nodes,
            method=method,
            generator=generator,
            **extra,
        )
        check_tree_result(res, tree, target.vocab_size)
        return res.tokens, res.num_tokens

    return _run_rounds(num_requests, num_tokens, x0, step)


# --------------------------------------------------------------------------------------
# Length policies (scheduler hooks)
# --------------------------------------------------------------------------------------


def fixed_length_policy(length: int) -> LengthPolicy:
    """ℓ_r = min(length, γ) for every request."""
    return lambda prop: torch.full_like(prop.lengths, length).clamp(max=prop.tokens.shape[1])


def random_length_policy(generator: torch.Generator) -> LengthPolicy:
    """ℓ_r uniform on [0, γ], independent of the proposal (causal; exercises ragged layouts)."""
    return lambda prop: torch.randint(0, prop.tokens.shape[1] + 1, prop.lengths.shape, generator=generator)


def throughput_length_policy(sps: Sequence[float], *, early_stop: bool = True) -> LengthPolicy:
    """Per-request throughput scheduler of the paper's Algorithm 1 (each request its own batch).

    With survivals a_j = c_1·…·c_j, the expected throughput of verifying ℓ drafts is
    Θ_ℓ = (1 + a_1 + … + a_ℓ)·SPS(ℓ+1), where ``sps[i]`` = SPS(i+1). early_stop=True admits
    positions while Θ keeps improving (causal: ℓ ≥ k depends on c_≤k, hence on x_<k only).
    early_stop=False takes the global argmax over ℓ (the retrospective search of Appendix A:
    admitting x_k can depend on c_{k+1}, which depends on x_k itself, so it is biased).
    """
    sps_t = torch.as_tensor(list(sps), dtype=torch.float64)

    def policy(prop: Proposal) -> torch.Tensor:
        gamma = prop.tokens.shape[1]
        if prop.confidence is None:
            raise ValueError("throughput_length_policy needs proposal.confidence")
        if sps_t.numel() < gamma + 1:
            raise ValueError(f"sps needs gamma + 1 = {gamma + 1} entries, got {sps_t.numel()}")
        survival = prop.confidence.double().cumprod(1)  # [R, γ]
        gain = torch.cat([torch.ones_like(survival[:, :1]), 1 + survival.cumsum(1)], 1)  # [R, γ+1]
        theta = gain * sps_t[: gamma + 1]
        if not early_stop:
            return theta.argmax(1)
        improving = theta[:, 1:] > theta[:, :-1]  # [R, γ]
        return improving.long().cumprod(1).sum(1)

    return policy


@dataclass(frozen=True)
class AppendixA:
    """The paper's Appendix A counterexample (vocabulary A=0, B=1, plus the anchor S=2)."""

    target: ToyLM  # p_t = (0.7, 0.3) at every position
    drafter: ToyDrafter  # p_d = (0.5, 0.5); confidence c_1 = 0.8 after S, c_2 = 0.9 after A, 0 after B
    anchor: int
    gamma: int
    sps: tuple[float, ...]  # SPS(1), SPS(2), SPS(3)
    target_first: torch.Tensor  # [3] exact first-token distribution (0.7, 0.3, 0)
    retrospective_first: torch.Tensor  # [3] what the retrospective scheduler yields (0.85, 0.15, 0)

    def causal_policy(self) -> LengthPolicy:
        """Early stop: Θ_1 = 0.9 < Θ_0 = 1, so ℓ = 0 before looking at x_1."""
        return throughput_length_policy(self.sps, early_stop=True)

    def retrospective_policy(self) -> LengthPolicy:
        """Global search: ℓ = 2 if x_1 = A (Θ_2 = 1.134), else 0."""
        return throughput_length_policy(self.sps, early_stop=False)


def appendix_a() -> AppendixA:
    """Build the Appendix A setting."""
    return AppendixA(
        target=ToyLM.from_probs(torch.tensor([0.7, 0.3, 0.0])),
        drafter=ToyDrafter(ToyLM.from_probs(torch.tensor([0.5, 0.5, 0.0])), confidence_table=torch.tensor([0.9, 0.0, 0.8])),
        anchor=2,
        gamma=2,
        sps=(1.0, 0.5, 0.45),
        target_first=torch.tensor([0.7, 0.3, 0.0], dtype=torch.float64),
        retrospective_first=torch.tensor([0.85, 0.15, 0.0], dtype=torch.float64),
    )


# -- end-to-end: continuations of a real target ------------------------------------------


@dataclass
class Continuations:
    """Exact probabilities of every continuation of ``depth`` tokens with probability >= min_prob."""

    tuples: torch.Tensor  # [K, depth] long
    probs: torch.Tensor  # [K] float64
    depth: int


@torch.no_grad()
def exact_continuations(target, prompt: Sequence[int], *, depth: int, min_prob: float, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0, chunk: int = 512) -> Continuations:
    """Enumerate continuations of ``prompt`` under the target at the given sampling settings.

    Prefixes are expanded breadth-first, keeping only those whose probability is at least
    ``min_prob`` (so at most 1/min_prob per depth); the remaining mass becomes one "other" bin
    in :func:`assert_continuations_match`. Uses full forwards of ``target.model`` (the
    reference, independent of the engine's cache machinery).
    """
    model = target.model
    prefixes = torch.empty(1, 0, dtype=torch.long)
    weights = torch.ones(1, dtype=torch.float64)
    base = torch.tensor(list(prompt), dtype=torch.long)
    for _ in range(depth):
        rows = []
        for start in range(0, prefixes.shape[0], chunk):
            part = prefixes[start : start + chunk]
            ids = torch.cat([base.expand(part.shape[0], -1), part], 1).to(target.device)
            logits = model(input_ids=ids).logits[:, -1].float()
            rows.append(logits_to_probs(logits, temperature, top_k, top_p).double().cpu())
        joint = weights[:, None] * torch.cat(rows)  # [P, V]
        keep = (joint >= min_prob).nonzero()
        prefixes = torch.cat([prefixes[keep[:, 0]], keep[:, 1:]], 1)
        weights = joint[keep[:, 0], keep[:, 1]]
    return Continuations(prefixes, weights, depth)


def assert_continuations_match(samples: torch.Tensor, exact: Continuations, *, alpha: float = 1e-4,
                               name: str = "continuations") -> GofResult:
    """Chi-square of sampled continuations [N, depth] against :func:`exact_continuations`."""
    V = int(max(int(samples.max()), int(exact.tuples.max()))) + 1
    keys = joint_index(exact.tuples, V)
    order = torch.argsort(keys)
    keys, probs = keys[order], exact.probs[order]
    idx = joint_index(samples.cpu(), V)
    pos = torch.searchsorted(keys, idx).clamp(max=len(keys) - 1)
    hit = keys[pos] == idx
    category = torch.where(hit, pos, torch.full_like(pos, len(keys)))  # last bin: everything else
    expected = torch.cat([probs, (1 - probs.sum()).clamp(min=0).reshape(1)])
    result = gof_test(category, expected)
    if result.p_value < alpha:
        raise AssertionError(f"distribution mismatch (alpha = {alpha:g})\n" + result.describe(name))
    return result


def check_engine_lossless(target, drafter, prompts: Sequence[Sequence[int]], *, per_prompt: int, sampling: dict,
                          block_size: int = 3, max_batch: int | None = None, seed: int = 11, scheduler=None,
                          name: str = "engine", verify: dict | None = None) -> list:
    """End-to-end check: the first 3 tokens the engine generates for each prompt (``per_prompt``
    seeded samples, 4 new tokens so round 1 verifies up to 2 drafts) match exact target
    sampling at ``sampling``; ``verify`` sets the engine's rules (``chain_verify``,
    ``tree_verify``; default: the engine's). Returns every request result, for extra assertions."""

    cfg = GenerationConfig(max_new_tokens=4, block_size=block_size, max_batch=max_batch or per_prompt, seed=seed,
                           **sampling, **(verify or {}))
    engine = SpeculativeEngine(target, drafter, cfg, scheduler=scheduler, stop_ids=[])
    out = []
    for i, prompt in enumerate(prompts):
        results = engine.generate([prompt] * per_prompt, seeds=[i * 10**6 + s for s in range(per_prompt)])
        samples = torch.tensor([r.output_ids[:3] for r in results])
        exact = exact_continuations(target, prompt, depth=3, min_prob=2e-4, **sampling)
        assert_continuations_match(samples, exact, name=f"{name} prompt {i} {sampling}")
        out += results
    return out


def results_by_concurrency(target, drafter, prompts: Sequence[Sequence[int]], concurrencies: Sequence[int],
                           **config) -> list[list]:
    """The engine's results for ``prompts``, once per concurrency (``max_batch``) with the same
    seeds; equal ``output_ids`` across them show the outputs do not depend on the batch."""

    return [
        SpeculativeEngine(target, drafter, GenerationConfig(max_batch=conc, **config), stop_ids=[]).generate(prompts)
        for conc in concurrencies
    ]
