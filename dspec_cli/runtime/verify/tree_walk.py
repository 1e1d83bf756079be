"""The machinery shared by the tree verifiers (:mod:`dspec_cli.runtime.verify.tree`,
:mod:`dspec_cli.runtime.verify.traversal`): the trees of padded rows and the top-down walk of the rejection methods, which tries a node's children in order, vectorised
over requests with a python loop over depth and sibling rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspec_cli.core.host import reads_free
from dspec_cli.core.types import VerifyResult


class Tree:
    """The trees of padded rows: tokens, parents [R, N] (row-local parents, 0 = the root; a column
    with parent -1 is not a node; a row's nodes are a prefix of its columns). Target rows are
    [R, N + 1] flattened (the root, then one row per column); no host reads."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor):  # [R, N] long each
        R, N = tokens.shape
        rows = torch.arange(R, device=tokens.device)
        j = torch.arange(N, device=tokens.device)
        self.p_start = rows * (N + 1)  # [R] flat target row of each root
        self.valid = parents >= 0  # [R, N]
        self.tokens = torch.where(self.valid, tokens, -1)  # [R, N]
        self.parents = torch.where(self.valid, parents, -1)  # [R, N]
        self.local = j + 1  # [N] local index of column j

    def depths(self) -> torch.Tensor:
        """Depth of every node [R, M+1] (root = 0) by pointer jumping; invalid columns -> 0."""
        R, M = self.parents.shape
        jump = torch.cat([self.parents.new_zeros(R, 1), self.parents.clamp(min=0)], 1)
        jump = torch.minimum(jump, torch.arange(M + 1, device=jump.device))  # keep in range
        dist = torch.cat([self.valid.new_zeros(R, 1), self.valid], 1).long()
        for _ in range(max(M, 1).bit_length()):
            dist = dist + dist.gather(1, jump)
            jump = jump.gather(1, jump)
        return dist

    def fanout(self) -> torch.Tensor:
        """Largest number of children of any node (0-d)."""
        R, M = self.parents.shape
        counts = torch.zeros(R, M + 1, dtype=torch.long, device=self.parents.device)
        counts.scatter_add_(1, self.parents.clamp(min=0), self.valid.long())
        return counts.max()


def outputs(R: int, depth: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed tokens and path [R, D+1], -1 filled."""
    tokens = torch.full((R, depth + 1), -1, dtype=torch.long, device=device)
    return tokens, torch.full_like(tokens, -1)


# begin(rows [R]) -> the residual state at the current nodes (a tuple of [R, ...] tensors)
Begin = Callable[[torch.Tensor], tuple]
# child(state, x [R]) -> (acceptance probability [R], a function giving the state after rejecting
# x: called only when some row rejects, which on a CPU is a free read)
Child = Callable[[tuple, torch.Tensor], tuple[torch.Tensor, Callable[[], tuple]]]
# final(d, state) -> token [R] at depth d when no child is accepted.
Final = Callable[[int, tuple], torch.Tensor]


def rejection_walk(tree: Tree, depth: int, fanout: int, coins: torch.Tensor, begin: Begin, child: Child,
                   final: Final) -> VerifyResult:
    """At the current node try its children in node order, one coin each (coins [R, M], padded
    like ``tree``), and move to the first accepted; else draw the final token and stop."""
    R, device = tree.valid.shape[0], tree.valid.device
    tokens, path = outputs(R, depth, device)
    cur = torch.zeros(R, dtype=torch.long, device=device)
    active = torch.ones(R, dtype=torch.bool, device=device)
    accepted = torch.zeros_like(cur)
    for d in range(depth + 1):
        if d and all_stopped(active):
            break
        state = begin(tree.p_start + cur)
        kids = tree.parents == cur[:, None]  # [R, M]
        rank = kids.long().cumsum(1) - 1
        moved = torch.zeros_like(active)
        nxt = cur.clone()
        for j in range(children_to_try(kids, active, fanout)):
            pick = kids & (rank == j)
            tried = pick.any(1) & active & ~moved
            col = pick.long().argmax(1, keepdim=True)  # [R, 1]
            prob, after = child(state, tree.tokens.gather(1, col).squeeze(1).clamp(min=0))
            ok = tried & (coins.gather(1, col).squeeze(1) < prob)
            moved |= ok
            nxt = torch.where(ok, col.squeeze(1) + 1, nxt)
            rejected = tried & ~ok
            if not reads_free(rejected) or bool(rejected.any()):
                rows = rejected[:, None]
                state = tuple(new if new is old else torch.where(rows, new, old)
                              for new, old in zip(after(), state, strict=True))
        node_tok = tree.tokens.gather(1, (nxt - 1).clamp(min=0)[:, None]).squeeze(1)
        tokens[:, d] = torch.where(moved, node_tok, torch.where(active, final(d, state), -1))
        path[:, d] = torch.where(active, cur, -1)
        cur = nxt
        accepted += moved
        active = moved
    return VerifyResult(accepted, tokens, accepted + 1, path)


def all_stopped(active: torch.Tensor) -> bool:
    """True when no walk is still active [R]: read on a CPU only (free there; a host sync per
    depth elsewhere, where the remaining depths run on inactive rows instead)."""
    return reads_free(active) and not bool(active.any())


def children_to_try(
    kids: torch.Tensor,  # [R, M] bool: the current nodes' children
    active: torch.Tensor,  # [R] bool: rows still walking
    fanout: int,
) -> int:
    """Children to try at the current nodes (kids [R, M]): on a CPU the most any active row's node
    has, elsewhere ``fanout`` (no host sync)."""
    if not reads_free(kids):
        return fanout
    return min(fanout, int((kids & active[:, None]).sum(1).max())) if kids.numel() else 0


def normalised(w: torch.Tensor) -> torch.Tensor:
    """w [R, V] / Σw per row; all-zero rows stay zero."""
    mass = w.sum(-1, keepdim=True)
    return w / torch.where(mass > 0, mass, torch.ones_like(mass))


def mass(w: torch.Tensor) -> torch.Tensor:  # w [R, V]
    """Σw per row [R] float64; 1 where it is 0 (all-zero rows stay zero after dividing)."""
    total = w.sum(-1).double()
    return torch.where(total > 0, total, 1.0)
