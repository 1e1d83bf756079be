"""The data that flows through a speculative round, shared by every layer.

A drafter returns a :class:`Proposal` (a chain, or a :class:`DraftTree`); the target returns a
:class:`PrefillOutput` when requests join; the verifier returns a :class:`VerifyResult`. :class:`Sampler` is what a drafter samples its drafts with.
Tensors are batched by request row r (R rows); token and node tensors are padded with
:data:`PAD` past each row's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

PAD = -1  # padding of token and node-index tensors past each row's length: never a token id or node



class Capability(str, Enum):
    """What a drafter can do beyond proposing a chain (``Drafter.capabilities``); members compare
    equal to their names as strings."""

    draft_probs = "draft_probs"  # proposals carry q for rejection sampling (else verified one-hot)
    confidence = "confidence"  # a learned confidence head (else the Σq² heuristic)
    tree = "tree"  # proposes draft trees
    trainable = "trainable"  # a TrainableDrafter: `dspec train` can train it
    marginals = "marginals"  # per-position distributions for tree builders (block_marginals, head_logits)

    def __str__(self) -> str:
        return self.value


@dataclass
class DraftTree:
    """A draft tree per request. Node 0 is the root (the anchor); nodes 1..N_r are drafts."""

    tokens: torch.Tensor  # [R, N] long, padded with PAD past num_nodes
    parents: torch.Tensor  # [R, N] long: local parent index (0 = root), parents precede children; PAD past num_nodes
    num_nodes: torch.Tensor  # [R] long
    # [R, N+1, V]: row 0 = the root's q, row i = node i's q (its children's distribution; children
    # are a sample without replacement from it, in node order). Set: verified by "sampled" at T > 0.
    draft_probs: torch.Tensor | None = None
    # the most children of any node, when the drafter knows it on the host (a static tree shape):
    # "sampled" verification then needs no host read to size its sibling loop
    fanout: int | None = None


@dataclass
class Proposal:
    """What a drafter proposes for one round."""

    tokens: torch.Tensor  # [R, γ] long (chain drafts; padded past `lengths` with PAD)
    lengths: torch.Tensor  # [R] long: valid draft tokens per request, <= γ
    draft_probs: torch.Tensor | None = None  # [R, γ, V] q_k; None = deterministic (one-hot) drafts
    confidence: torch.Tensor | None = None  # [R, γ] c_k ≈ P(x_k accepted | x_<k accepted), in (0, 1)
    tree: DraftTree | None = None  # set by tree drafters instead of a chain


class Sampler(Protocol):
    """Sampling at the run's settings, with per-request counter-based randomness."""

    greedy: bool  # temperature 0 (probs are one-hot; nothing is sampled)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
        ...

    def sample(self, probs: torch.Tensor, step: int) -> torch.Tensor:
        """Draw of draft ``step``: probs [R, V] -> [R]; or of drafts step..step+n−1 at once:
        probs [R, n, V] -> [R, n] (the same tokens as n single calls)."""
        ...

    def sample_distinct(self, probs: torch.Tensor, n: int, step: int) -> torch.Tensor:
        """n draws without replacement, in draw order, from each row of probs [R, W, V] -> [R, W, n]
        (the children of W tree nodes at depth ``step``)."""
        ...


@dataclass
class VerifyResult:
    """Outcome of one verification step for R requests.

    accepted:   [R] long, accepted drafts per request
    tokens:     [R, W] long, the accepted drafts then the correction/bonus token, PAD padded
    num_tokens: [R] long, committed tokens per request (= accepted + 1)
    path:       [R, D+1] long or None (trees): path[r, 0] = 0 is the root, path[r, j] the
                node accepted at depth j (j <= accepted); PAD padded. The bonus token is sampled
                from the target row of node path[r, accepted].
    """

    accepted: torch.Tensor
    tokens: torch.Tensor
    num_tokens: torch.Tensor
    path: torch.Tensor | None = None


@dataclass
class PrefillOutput:
    """Target outputs of a prefill of R_new joining requests, in prompt order."""

    logits: torch.Tensor  # [R_new, V] float: each prompt's last-position logits
    hidden: list[torch.Tensor]  # R_new taps [L_r, n·d], one per prompt of L_r tokens
    rows: torch.Tensor  # [R_new] long: batch rows of the new requests
