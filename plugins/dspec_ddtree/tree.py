"""DDTree's best-first draft tree, with the expansions batched depth by depth.

The DDTree reference pops prefixes from a heap in order of their score (the sum of the draft
log-probs along the path: the product of the per-position distributions), pushing each popped
node's next sibling and first child among the top-K tokens of its distribution, until the
budget B is reached. That yields the B best-scoring prefixes among those reachable through
top-K children — a prefix-closed set, because a child never scores above its parent.

:func:`grow_tree` computes the same set without popping one node at a time: a node of the B
best has its parent among the B best and at most B − 1 better prefixes at its own depth, so
keeping the B best candidates of each depth as that depth's frontier loses none of them. Each
depth therefore needs one batched expansion of at most B frontier nodes (instead of one
expansion per popped node), and the B best of all candidates are kept by
:func:`dspec_cli.runtime.tree_select.select_tree` (stable: at equal scores the shallower, earlier
candidate wins, so parents always come first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspec_cli import select_tree

__all__ = ["Expand", "grow_tree"]

# expand(slot, tokens [R, W], state) -> (logits [R, W or 1, V], state'): the distribution of the
# children of the W frontier nodes of depth ``slot`` (their tokens; at slot 0 the anchors), given
# the opaque per-node ``state`` (None at slot 0, else what the previous call returned, with its
# rows re-gathered along dimension 1 to follow the frontier; it must be a tensor [R, W, ...] or None).
Expand = Callable[[int, torch.Tensor, object], tuple[torch.Tensor, object]]


def grow_tree(
    expand: Expand,
    anchors: torch.Tensor,  # [R] long: the roots
    depth: int,
    budget: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``budget`` best prefixes of at most ``depth`` tokens, each node's children taken from
    the ``topk`` most probable tokens of its distribution (log-softmax of ``expand``'s logits).

    Returns tokens [R, N], parents [R, N] (local: 0 = root, node i is i + 1, parents first) and
    scores [R, N] (cumulative log-probs), N = min(budget, candidates), depth-major order.
    """
    if depth < 1 or budget < 1 or topk < 1:
        raise ValueError(f"depth, budget and topk must be >= 1, got {depth}, {budget}, {topk}")
    R, dev = anchors.shape[0], anchors.device
    tok = anchors[:, None]  # [R, W] frontier tokens (W = 1: the root)
    score = torch.zeros(R, 1, device=dev)  # [R, W] their cumulative log-probs
    index = torch.full((R, 1), -1, dtype=torch.long, device=dev)  # [R, W] their candidate index (-1 = root)
    state = None
    scores, tokens, parents = [], [], []
    offset = 0
    for slot in range(depth):
        logits, state = expand(slot, tok, state)  # [R, W or 1, V]
        top = logits.topk(topk, dim=-1)
        logp = top.values - logits.logsumexp(-1, keepdim=True)  # [R, W or 1, K]
        cand = (score[..., None] + logp).flatten(1)  # [R, W·K]
        kids = top.indices.expand(R, tok.shape[1], topk).flatten(1)  # [R, W·K]
        scores.append(cand)
        tokens.append(kids)
        parents.append(index.repeat_interleave(topk, dim=1))
        if slot + 1 < depth:
            pick = cand.topk(min(budget, cand.shape[1]), dim=1).indices  # [R, W'] next frontier
            tok, score, index = kids.gather(1, pick), cand.gather(1, pick), offset + pick
            if state is not None:
                rows = (pick // topk).view(R, -1, *([1] * (state.dim() - 2)))
                state = state.gather(1, rows.expand(-1, -1, *state.shape[2:]))
        offset += cand.shape[1]
    return select_tree(torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), budget)
