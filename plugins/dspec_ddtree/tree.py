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
candidate wins, so parents always come first). Unlike the reference, the greedy chain (the
spine: best child of best child ...) is always kept, so a tree never accepts less than the
chain at T = 0; with the chain's deeper nodes less probable than shallow siblings, a pure
best-first tree of 16 nodes can stop above the chain's depth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspec_cli import select_tree

__all__ = ["Expand", "grow_sampled_tree", "grow_tree"]

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
    the ``topk`` most probable tokens of its distribution (log-softmax of ``expand``'s logits),
    plus the spine: the most probable child of the root, its most probable child, and so on to
    ``depth`` (a greedy chain's drafts), kept first, so at T = 0 the tree accepts at least what
    the chain does. The spine's nodes count against the budget.

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
    scores, tokens, parents, spine = [], [], [], []
    offset = 0
    for slot in range(depth):
        logits, state = expand(slot, tok, state)  # [R, W or 1, V]
        top = logits.topk(topk, dim=-1)
        logp = top.values - logits.logsumexp(-1, keepdim=True)  # [R, W or 1, K]
        cand = (score[..., None] + logp).flatten(1)  # [R, W·K]
        kids = top.indices.expand(R, tok.shape[1], topk).flatten(1)  # [R, W·K]
        # frontier node 0 is the spine's end (it ranks first below), candidate 0 its best child
        on_spine = torch.zeros_like(cand, dtype=torch.bool)
        on_spine[:, 0] = True
        scores.append(cand)
        tokens.append(kids)
        parents.append(index.repeat_interleave(topk, dim=1))
        spine.append(on_spine)
        if slot + 1 < depth:
            rank = torch.where(on_spine, float("inf"), cand)
            pick = rank.topk(min(budget, cand.shape[1]), dim=1).indices  # [R, W'] next frontier, spine first
            tok, score, index = kids.gather(1, pick), cand.gather(1, pick), offset + pick
            if state is not None:
                rows = (pick // topk).view(R, -1, *([1] * (state.dim() - 2)))
                state = state.gather(1, rows.expand(-1, -1, *state.shape[2:]))
        offset += cand.shape[1]
    return select_tree(torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), budget, torch.cat(spine, 1))


# probs(logits [n, V]) -> q [n, V]: the run's sampling distribution (temperature, top-k, top-p).
Probs = Callable[[torch.Tensor], torch.Tensor]
# draw(slot, q [R, W, V], n) -> [R, W, n]: n draws without replacement from each frontier node's q, in order.
Draw = Callable[[int, torch.Tensor, int], torch.Tensor]


def grow_sampled_tree(
    expand: Expand,
    probs: Probs,
    draw: Draw,
    anchors: torch.Tensor,  # [R] long: the roots
    depth: int,
    budget: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled draft tree of at most ``budget`` nodes and ``depth`` levels, for lossless
    verification with ``verify_tree(method="sampled")``.

    Depth by depth, the frontier nodes' child distributions q = ``probs(expand(...))`` are
    computed; then the depth's child slots are allocated across the frontier (m_v children of
    node v) from what is already drafted only: candidate j of node v is worth
    s_v + log q_(j)(v) (s_v: v's path log-prob under q, q_(j) the j-th largest probability of
    q_v); a candidate is taken when it ranks among the remaining budget's best against the
    candidates themselves and a forecast of the deeper levels (each candidate's chain of
    descendants decaying by ρ per level, ρ = the frontier's mean top-1 probability). The spine
    (frontier node 0: first child of first child ..., a chain's drafts) always gets a child,
    its deeper levels' slots reserved first, so the tree holds the chain. So m_v never depends
    on v's children, as losslessness requires, and m_v never exceeds q_v's support. Then v's
    m_v children are drawn without replacement from q_v by ``draw`` and
    stored in draw order.

    Returns tokens [R, N] (-1 padded), parents [R, N] (local, 0 = root, parents first; -1
    padded), scores [R, N] (path log-probs under q; -inf padded), num_nodes [R] and
    draft_probs [R, N + 1, V] (row 0: the root's q, row i: node i's q; zero for leaves of the
    last level), N = budget.
    """
    if depth < 1 or budget < 1 or topk < 1:
        raise ValueError(f"depth, budget and topk must be >= 1, got {depth}, {budget}, {topk}")
    R, dev = anchors.shape[0], anchors.device
    N = budget
    tok = anchors[:, None]  # [R, W] frontier tokens
    score = torch.zeros(R, 1, device=dev)  # [R, W] path log-probs
    node = torch.zeros(R, 1, dtype=torch.long, device=dev)  # [R, W] local node index (0 = root)
    alive = torch.ones(R, 1, dtype=torch.bool, device=dev)  # [R, W] real frontier entries
    used = torch.zeros(R, dtype=torch.long, device=dev)
    tokens = torch.full((R, N + 1), -1, dtype=torch.long, device=dev)  # column N: discarded writes
    parents = torch.full_like(tokens, -1)
    scores = torch.full((R, N + 1), float("-inf"), device=dev)
    draft_probs = None
    state = None
    for slot in range(depth):
        W = tok.shape[1]
        logits, state = expand(slot, tok, state)  # [R, W or 1, V]
        V = logits.shape[-1]
        q = probs(logits.flatten(0, 1).float()).view(R, -1, V).expand(R, W, V)  # [R, W, V]
        if draft_probs is None:
            draft_probs = torch.zeros(R, N + 2, V, device=dev)  # row N + 1: discarded writes
        rows = torch.where(alive, node, N + 1)
        draft_probs.scatter_(1, rows[..., None].expand(R, W, V), q)
        K = min(topk, V, N)
        top_q = q.topk(K, dim=-1).values  # [R, W, K], descending
        est = torch.where(alive[..., None], score[..., None] + top_q.log(), float("-inf")).flatten(1)  # [R, W·K]
        remaining = (N - used)[:, None]  # [R, 1]
        levels = depth - slot - 1  # deeper levels still to come
        union = est
        if levels:
            live = alive.float()
            rho = (top_q[..., 0] * live).sum(1) / live.sum(1).clamp(min=1)  # [R]
            decay = rho.clamp(min=1e-6).log()[:, None, None] * torch.arange(1, levels + 1, device=dev)  # [R, 1, L]
            union = torch.cat([est, (est[..., None] + decay).flatten(1)], 1)  # candidates first: they win ties
        ranked = union.sort(dim=1, descending=True, stable=True)
        # the spine (first child of the first child ... : a chain's drafts) always continues to the
        # deepest level, so the tree never accepts less than the chain: its deeper levels are reserved
        spine = alive[:, 0] & (remaining[:, 0] > 0)  # [R] frontier node 0 is the spine's end
        reserve = torch.where(spine, (remaining[:, 0] - 1).clamp(min=0, max=levels), 0)  # [R] spine nodes below
        free = remaining - reserve[:, None]  # [R, 1] slots this level may take
        top = torch.arange(union.shape[1], device=dev) < free
        n = ((ranked.indices < est.shape[1]) & top & torch.isfinite(ranked.values)).sum(1)  # [R] slots this level
        order = est.sort(dim=1, descending=True, stable=True).indices
        chosen = torch.zeros_like(est, dtype=torch.bool).scatter_(
            1, order, torch.arange(est.shape[1], device=dev) < n[:, None]
        ) & torch.isfinite(est)
        # the spine's next node takes the place of the level's last pick when it was not picked
        last = order.gather(1, (n - 1).clamp(min=0)[:, None])  # [R, 1]
        swap = spine & ~chosen[:, 0] & (n > 0)  # [R]
        chosen &= ~torch.zeros_like(chosen).scatter_(1, last, swap[:, None])
        chosen[:, 0] |= spine
        m = chosen.view(R, W, K).sum(-1)  # [R, W] children per frontier node (a prefix of its candidates)
        kids = torch.zeros(R, W, K, dtype=torch.long, device=dev)  # [R, W, K]: draws without replacement, in order
        # on a CPU draw only as many siblings as some node takes (a free read there); elsewhere K
        n_draw = int(m.max()) if dev.type == "cpu" else K
        if n_draw:
            kids[..., :n_draw] = draw(slot, q, n_draw)
        valid = (torch.arange(K, device=dev) < m[..., None]).flatten(1)  # [R, W·K]
        kid_score = (score[..., None] + q.gather(-1, kids).log()).flatten(1)
        count = valid.sum(1)
        W2 = min(N, W * K)
        if dev.type == "cpu":  # only real children go on (a free read there): later levels expand fewer rows
            W2 = max(min(W2, int(count.max())), 1)
        pick = (~valid).long().argsort(dim=1, stable=True)[:, :W2]  # [R, W2] the valid children first, in order
        new_alive = torch.arange(W2, device=dev) < count[:, None]
        new_node = used[:, None] + 1 + torch.arange(W2, device=dev)
        tok = kids.flatten(1).gather(1, pick)
        score = kid_score.gather(1, pick)
        par = node.repeat_interleave(K, dim=1).gather(1, pick)
        at = torch.where(new_alive, new_node - 1, N)
        tokens.scatter_(1, at, tok)
        parents.scatter_(1, at, par)
        scores.scatter_(1, at, score)
        node, alive, used = new_node, new_alive, used + count
        if state is not None and slot + 1 < depth:
            rows = (pick // K).view(R, -1, *([1] * (state.dim() - 2)))
            state = state.gather(1, rows.expand(-1, -1, *state.shape[2:]))
    tokens, parents, scores = tokens[:, :N], parents[:, :N], scores[:, :N]
    return tokens, parents, scores, used, draft_probs[:, : N + 1]
