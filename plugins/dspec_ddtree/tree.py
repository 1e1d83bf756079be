"""DDTree's best-first draft tree, with the expansions batched depth by depth, and sampled trees.

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

Sampled trees (T > 0, verified by recursive rejection or traversal verification) draw each
node's children without replacement from the run's q into a static shape, :func:`sampled_shape`:
the nodes of largest worth under per-rank acceptance rates, the spine first, chosen once per
option set. With confidence budgets each request's drafted tree is then cut to the nodes DSpark's
Algorithm 1 admits (:func:`node_survival`, :func:`prune_tree`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from dspec_cli import PAD, reads_free, select_tree

__all__ = ["Expand", "grow_sampled_tree", "grow_tree", "node_depths", "node_survival", "prune_tree", "sampled_shape"]

# expand(slot, tokens [R, W], state) -> (logits [R, W or 1, V], state'): the distribution of the
# children of the W frontier nodes of depth ``slot`` (their tokens; at slot 0 the anchors), given
# the opaque per-node ``state`` (None at slot 0, else what the previous call returned, with its
# rows re-gathered along dimension 1 to follow the frontier; it must be a tensor [R, W, ...] or None).
Expand = Callable[[int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]


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


def _grow_shape(budget: int, depth: int, topk: int, accept: float, rescue: float) -> list[tuple[int, float]]:
    """The nodes of :func:`sampled_shape` in the order they are chosen, as (parent, worth); the
    root (-1, 1.0) first."""
    if depth < 1 or budget < 1 or topk < 1:
        raise ValueError(f"depth, budget and topk must be >= 1, got {depth}, {budget}, {topk}")
    rank_rate = [accept] + [(1 - accept) * (1 - rescue) ** (j - 2) * rescue for j in range(2, topk + 1)]
    nodes = [(-1, 1.0)]  # (parent, worth)
    level = [0]
    kids: list[int] = [0]  # children so far, per node

    def add(parent: int) -> None:
        nodes.append((parent, nodes[parent][1] * rank_rate[kids[parent]]))
        level.append(level[parent] + 1)
        kids[parent] += 1
        kids.append(0)

    for _ in range(min(depth, budget)):  # the spine
        add(len(nodes) - 1)
    heap: list[tuple[float, int, int]] = []  # (-worth of the parent's next child, tie order, parent)

    def offer(parent: int) -> None:
        if level[parent] < depth and kids[parent] < topk:
            heapq.heappush(heap, (-nodes[parent][1] * rank_rate[kids[parent]], len(nodes), parent))

    for v in range(len(nodes)):
        offer(v)
    while len(nodes) - 1 < budget and heap:
        _, _, parent = heapq.heappop(heap)
        add(parent)
        offer(parent)
        offer(len(nodes) - 1)
    return nodes


def sampled_shape(budget: int, depth: int, topk: int, accept: float, rescue: float) -> torch.Tensor:
    """The static shape of a sampled tree: children [S + 1, K] long, row s the shape ids of node
    s's children in draw order (-1 padded; row 0 the root; ids depth-major, a node's children
    after those of the nodes before it at its depth, as :func:`grow_sampled_tree` numbers them).

    Recursive rejection accepts a node's first child with probability ≈ ``accept`` and, when
    the j − 1 siblings before it were rejected, its j-th child with probability ≈ ``rescue``:
    the j-th child is reached and accepted with a_1 = accept, a_j = (1 − accept)(1 −
    rescue)^(j−2)·rescue. A node's worth is the product of a along its path (the chance that
    the target accepts the path); the spine (first child of first child ..., a chain's drafts)
    is kept to the full depth, then the most valuable other nodes, at most ``topk`` children
    per node, until ``budget`` nodes (Sequoia-style static trees from per-rank rates)."""
    nodes = _grow_shape(budget, depth, topk, accept, rescue)
    kids: list[list[int]] = [[] for _ in nodes]
    for v, (parent, _) in enumerate(nodes[1:], 1):
        kids[parent].append(v)
    # renumber depth-major, each depth in (parent's new id, rank) order
    order, frontier = [0], [0]
    while frontier:
        frontier = [c for v in frontier for c in kids[v]]
        order += frontier
    new_id = {old: i for i, old in enumerate(order)}
    children = torch.full((len(order), max(map(len, kids))), -1, dtype=torch.long)
    for old, i in new_id.items():
        for j, c in enumerate(kids[old]):
            children[i, j] = new_id[c]
    return children


def grow_sampled_tree(
    expand: Expand,
    probs: Probs,
    draw: Draw,
    anchors: torch.Tensor,  # [R] long: the roots
    depth: int,
    shape: torch.Tensor,  # [S + 1, K] long: :func:`sampled_shape`
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled draft tree of the static ``shape`` cut at ``depth``, for lossless verification
    with ``verify_tree(method="traversal")`` or ``method="sampled"``.

    Depth by depth, the frontier nodes' child distributions q = ``probs(expand(...))`` are
    computed and node v's m_v children (its children in ``shape``, at most the size of q_v's
    support, so m_v never depends on v's children, as losslessness requires) are drawn without
    replacement from q_v by ``draw`` and stored in draw order. A node missing because its
    parent's support was smaller takes its subtree with it.

    Returns tokens [R, N] (-1 padded), parents [R, N] (local, 0 = root, parents first; -1
    padded), scores [R, N] (path log-probs under q; -inf padded), num_nodes [R] and
    draft_probs [R, N + 1, V] (row 0: the root's q, row i: node i's q; zero for leaves of the
    last level), N = S (the shape's nodes).
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    R, dev = anchors.shape[0], anchors.device
    shape = shape.to(dev)
    N, K = shape.shape[0] - 1, shape.shape[1]
    num_kids = (shape >= 0).sum(1)  # [S + 1]
    tok = anchors[:, None]  # [R, W] frontier tokens
    score = torch.zeros(R, 1, device=dev)  # [R, W] path log-probs
    node = torch.zeros(R, 1, dtype=torch.long, device=dev)  # [R, W] local node index (0 = root)
    sid = torch.zeros(R, 1, dtype=torch.long, device=dev)  # [R, W] shape id (-1: not a node)
    used = torch.zeros(R, dtype=torch.long, device=dev)
    tokens = torch.full((R, N + 1), PAD, dtype=torch.long, device=dev)  # column N: discarded writes
    parents = torch.full_like(tokens, PAD)
    scores = torch.full((R, N + 1), float("-inf"), device=dev)
    draft_probs = None
    state = None
    for slot in range(depth):
        W = tok.shape[1]
        alive = sid >= 0
        logits, state = expand(slot, tok, state)  # [R, W or 1, V]
        V = logits.shape[-1]
        q = probs(logits.flatten(0, 1).float()).view(R, -1, V).expand(R, W, V)  # [R, W, V]
        if draft_probs is None:
            draft_probs = torch.zeros(R, N + 2, V, device=dev)  # row N + 1: discarded writes
        rows = torch.where(alive, node, N + 1)
        draft_probs.scatter_(1, rows[..., None].expand(R, W, V), q)
        planned = torch.where(alive, num_kids[sid.clamp(min=0)], 0)  # [R, W]
        m = torch.minimum(planned, (q > 0).sum(-1))  # [R, W] children per node
        kids = torch.zeros(R, W, K, dtype=torch.long, device=dev)  # [R, W, K]: draws without replacement, in order
        # on a CPU draw only as many siblings as some node takes (a free read there); elsewhere K
        n_draw = int(m.max()) if reads_free(m) else K
        if n_draw == 0:
            break
        kids[..., :n_draw] = draw(slot, q, n_draw)
        valid = (torch.arange(K, device=dev) < m[..., None]).flatten(1)  # [R, W·K]
        kid_score = (score[..., None] + q.gather(-1, kids).log()).flatten(1)
        kid_sid = shape[sid.clamp(min=0)].flatten(1)  # [R, W·K]
        count = valid.sum(1)
        W2 = min(N, W * K)
        if reads_free(count):  # only real children go on (a free read there): later levels expand fewer rows
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
        node, used = new_node, used + count
        sid = torch.where(new_alive, kid_sid.gather(1, pick), -1)
        if state is not None and slot + 1 < depth:
            rows = (pick // K).view(R, -1, *([1] * (state.dim() - 2)))
            state = state.gather(1, rows.expand(-1, -1, *state.shape[2:]))
    tokens, parents, scores = tokens[:, :N], parents[:, :N], scores[:, :N]
    assert draft_probs is not None  # written at the first slot
    return tokens, parents, scores, used, draft_probs[:, : N + 1]


def node_depths(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth of every node [R, N+1] (column 0: the root, depth 0) from parents [R, N] (local,
    parents first, -1 padded; padded nodes get 0), for trees at most ``depth`` deep."""
    R, N = parents.shape
    par = torch.cat([parents.new_zeros(R, 1), parents.clamp(min=0)], 1)  # [R, N+1]; the root its own parent
    real = torch.cat([parents.new_zeros(R, 1, dtype=torch.bool), parents >= 0], 1)
    d = torch.zeros_like(par)
    for _ in range(depth):
        d = torch.where(real, d.gather(1, par) + 1, 0)
    return d


def node_survival(
    parents: torch.Tensor,  # [R, N] long, local (0 = root), -1 padded; parents first, siblings in draw order
    confidence: torch.Tensor,  # [R, N+1]: c_v, the chance that node v's first child is accepted once v is
    rescue: float,
    depth: int,
) -> torch.Tensor:
    """The chance that each node's path is accepted, a [R, N] float64 (0 for padded nodes), with
    :func:`sampled_shape`'s rates made per node: node v's j-th child (in draw order) is worth
    a_v·c_v for j = 1 and a_v·min(c_v, (1 − c_v)(1 − rescue)^(j−2)·rescue) after (so a node never
    outranks an earlier sibling or its parent: admitting by value keeps the tree prefix-closed)."""
    R, N = parents.shape
    par = parents.clamp(min=0)
    earlier = (parents[:, :, None] == parents[:, None, :]) & torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)
    rank = earlier.sum(-1)  # [R, N]: earlier siblings
    c = confidence.double().gather(1, par)  # [R, N]: the parent's confidence
    later = (1 - c) * (1 - rescue) ** (rank - 1).clamp(min=0) * rescue
    rate = torch.where(rank == 0, c, torch.minimum(c, later))
    a = torch.ones(R, N + 1, dtype=torch.float64, device=parents.device)
    for _ in range(depth):
        a = torch.cat([a[:, :1], a.gather(1, par) * rate], 1)
    return torch.where(parents >= 0, a[:, 1:], 0.0)


def prune_tree(
    tokens: torch.Tensor,  # [R, N] long, -1 padded
    parents: torch.Tensor,  # [R, N] long, local, -1 padded
    scores: torch.Tensor,  # [R, N] float, -inf padded
    draft_probs: torch.Tensor,  # [R, N+1, V]
    keep: torch.Tensor,  # [R, N] bool, prefix-closed (a kept node's parent is kept)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept nodes of each tree, renumbered in their order (parents still first, siblings in
    draw order): tokens, parents, scores [R, N'] (padded as the input), num_nodes [R] and
    draft_probs [R, N'+1, V], N' = the most nodes any tree keeps (at least 1) where reading that
    is free, else N' = N (no host read)."""
    R, N = tokens.shape
    count = keep.sum(1)
    if reads_free(count):
        width = max(int(count.max()) if keep.numel() else 0, 1)  # one padded column when no node is kept
    else:
        width = max(N, 1)
    order = (~keep).long().argsort(dim=1, stable=True)[:, :width]  # [R, N'] kept nodes first, in order
    alive = torch.arange(width, device=tokens.device) < count[:, None]
    new_id = torch.cat([keep.new_zeros(R, 1, dtype=torch.long), keep.long().cumsum(1)], 1)  # [R, N+1]: old -> new
    old_parent = parents.gather(1, order).clamp(min=0)
    new_parents = torch.where(alive, new_id.gather(1, old_parent), -1)
    new_tokens = torch.where(alive, tokens.gather(1, order), -1)
    new_scores = torch.where(alive, scores.gather(1, order), float("-inf"))
    rows = torch.cat([order.new_zeros(R, 1), order + 1], 1)  # [R, N'+1] draft_probs rows (root first)
    q = draft_probs.gather(1, rows[..., None].expand(-1, -1, draft_probs.shape[-1]))
    q = q * torch.cat([alive.new_ones(R, 1), alive], 1)[..., None]
    return new_tokens, new_parents, new_scores, count, q
