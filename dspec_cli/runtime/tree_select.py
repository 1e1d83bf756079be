"""EAGLE-2 dynamic-tree selection from depth-major candidates (EAGLE-2, Li et al. 2024, §4).

The drafter expands, depth by depth, the top-k children of the k best frontier nodes and
records every candidate with its cumulative log-probability (its parent's score plus its own
draft log-prob, so never above its parent's). :func:`select_tree` keeps the best candidates
under the node budget; a stable sort over depth-major candidates ranks a parent before any
child of equal score, so the kept set is always prefix-closed. Everything is deterministic
given the draft logits, so the tree is verified as one-hot drafts (``verify_tree`` with
``method="recursive"`` or ``"match"``).
"""

from __future__ import annotations

import torch

from dspec_cli.core.types import PAD

__all__ = ["best_path", "select_tree"]


def select_tree(
    scores: torch.Tensor,  # [R, C] cumulative log-probs of the candidates, depth-major
    tokens: torch.Tensor,  # [R, C] candidate tokens
    parents: torch.Tensor,  # [R, C] candidate index of each parent (earlier), -1 = root
    budget: int,
    first: torch.Tensor | None = None,  # [R, C] bool: candidates kept before any other
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``budget`` best candidates (all of them if fewer) as a tree in candidate order;
    candidates marked ``first`` (a prefix-closed set, e.g. a chain from the root) rank above
    every other, in candidate order.

    Returns tokens [R, N], parents [R, N] (local index: 0 = root, node i is i + 1, parents
    first) and scores [R, N], N = min(budget, C).
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    R, C = scores.shape
    n = min(budget, C)
    rank = scores if first is None else torch.where(first, float("inf"), scores)
    best = rank.sort(dim=1, descending=True, stable=True).indices[:, :n]
    keep = best.sort(dim=1).values  # [R, N] candidate ids, depth-major, so parents come first
    local = torch.zeros(R, C, dtype=torch.long, device=scores.device)
    local.scatter_(1, keep, torch.arange(1, n + 1, device=scores.device).expand(R, n))
    par = parents.gather(1, keep)
    tree_parents = torch.where(par < 0, 0, local.gather(1, par.clamp(min=0)))
    return tokens.gather(1, keep), tree_parents, scores.gather(1, keep)


def best_path(
    tokens: torch.Tensor,  # [R, N]
    parents: torch.Tensor,  # [R, N] local parent index (0 = root)
    scores: torch.Tensor,  # [R, N]
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy descent from the root through the best-scoring child: (tokens [R, depth] padded
    with PAD, lengths [R])."""
    R = tokens.shape[0]
    cur = torch.zeros(R, dtype=torch.long, device=tokens.device)
    active = torch.ones(R, dtype=torch.bool, device=tokens.device)
    lengths = torch.zeros_like(cur)
    path = torch.zeros(R, depth, dtype=torch.long, device=tokens.device)
    for d in range(depth):
        kids = parents == cur[:, None]  # [R, N]
        pick = torch.where(kids, scores, float("-inf")).argmax(1)  # [R]
        active &= kids.any(1)
        path[:, d] = torch.where(active, tokens.gather(1, pick[:, None]).squeeze(1), PAD)
        cur = torch.where(active, pick + 1, cur)
        lengths += active
    return path, lengths
