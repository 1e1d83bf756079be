"""Tree verification (torch; vectorised over requests, a python loop over depth).

Request r has nodes 1..N_r (local indices; 0 is the root, i.e. the anchor row) with draft
tokens and parents (parent 0 = child of the root; parents precede children). Its target rows
are the root row, then one row per node in order: Σ(N_r + 1) rows in all.

Four lossless walks, all starting at the root:

* ``"match"`` (sample-and-match, DDTree / JetSpec): at the current node draw y from the
  target's p (exponential race with one noise vector per depth, or with ``final_draw=
  "inverse_cdf"`` the inverse CDF with one uniform per depth); move to the first child whose
  token is y, else stop. The last draw is the bonus token. Every committed token is a target
  sample from the right conditional, so it is exact at any temperature and whatever the
  tree; at T = 0 it is greedy path matching.
* ``"recursive"`` (SpecInfer / EAGLE-2 recursive rejection for deterministic tree drafts):
  at the current node try its children in order, accepting child x with probability
  p'(x) / Σp' where p' starts at p and has each rejected child's token zeroed; if none is
  accepted, draw the final token from p'. One coin per node, final-token noise per depth.
  Exact when the tree is chosen deterministically from the drafter (q one-hot); it gives the
  same distribution as "match" (both accept child x with probability p(x) overall).
* ``"sampled"`` (recursive rejection sampling over siblings drawn without replacement; Jeon et
  al. 2024, "Recursive Speculative Decoding", and SpecInfer's multi-step speculative
  sampling): for trees whose children of node v are a sequential sample without replacement
  from a draft distribution q_v (``draft_probs``, one row per target row). At the current node
  p' = p_v, q' = q_v; for each child x in node order accept with probability
  min(1, p̂'(x) / q̂'(x)) (hats: normalised) and move to it; on a rejection
  p' ← max(p̂' − q̂', 0) and q' ← q̂' with x zeroed. If no child is accepted the final token is
  drawn from p' (p_v if p' vanished numerically); at a node without children that is the
  bonus token from p_v. One coin per node, final-token noise per depth (as "match").

  Why it is exact: given the earlier siblings, child x_j is distributed as q with the earlier
  tokens removed, renormalised, i.e. as q̂' (the coins are independent of the drafts), so each
  child is one step of standard speculative sampling of p̂' from q̂': it accepts x with
  probability min(1, p̂'/q̂')(x), and on a rejection the output must be a sample of the
  residual r = norm(max(p̂' − q̂', 0)). The remaining siblings are a without-replacement sample
  from q̂' without x, and r(x) = 0 after a rejection (rejection needs p̂'(x) < q̂'(x)), so the
  rest of the walk is the same procedure with target r: by induction on the number of children
  left (base case: no child, draw from p') it outputs exactly r, whatever x was. Hence the
  node's output token is distributed as p_v. Given it is child x, the next token comes from
  p_x and x's own children are a fresh without-replacement sample from q_x (their number may
  depend on anything drafted before them, not on their values), so by induction over depth
  every committed token has the target's conditional distribution. A child with q̂'(x) = 0
  (outside q's remaining support, e.g. after it is exhausted) can only be a deterministic
  choice; it is verified as a one-hot draft (q̂' := δ_x), which is exact too.
* ``"traversal"`` (traversal verification, Weng et al. 2025, arXiv 2505.12398) for the same
  sampled trees: block verification's sequence-level acceptance carried down the tree, the
  same as ``"sampled"`` at the root and more accepting below it; the rule and why it is exact are in
  :mod:`dspec_cli.runtime.verify.traversal`.

Randomness: one coin per node (``uniforms``, or counter-based with salt NODE_SALT + node) for
every method but "match", and one target draw per depth: an exponential race with ``noise``
[R, D+1, V] (row d for depth d), or with ``final_draw="inverse_cdf"`` the inverse CDF with one
uniform per depth.
"""

from __future__ import annotations

import torch

from dspec_cli.core.host import reads_free
from dspec_cli.core.ragged import to_grid
from dspec_cli.core.sampling import (
    NODE_SALT,
    NOISE_SALT,
    exponential,
    sample_from_probs,
    sample_inverse_cdf,
    torch_exponential,
    torch_uniform,
    uniform,
)
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import checks, reference, traversal
from dspec_cli.runtime.verify.tree_walk import (
    Tree,
    all_stopped,
    mass,
    normalised,
    outputs,
    rejection_walk,
)

METHODS = ("match", "recursive", "sampled", "traversal")
SAMPLED_METHODS = ("sampled", "traversal")  # trees whose siblings are drawn without replacement from q


def verify_tree(
    target_probs: torch.Tensor,  # [Σ(N_r+1), V]
    tree_tokens: torch.Tensor,  # [ΣN_r]
    tree_parents: torch.Tensor,  # [ΣN_r] local parent index, 0 = root
    num_nodes: torch.Tensor,  # [R]
    *,
    method: str = "match",
    draft_probs: torch.Tensor | None = None,  # sampled, traversal: [Σ(N_r+1), V] q of each row's children
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # all but match: [ΣN_r] float64 coin per node, in (0, 1)
    noise: torch.Tensor | None = None,  # [R, D+1, V] Exp(1): the target draw at depth d races with row d
    seeds: torch.Tensor | None = None,  # [R] int64
    offsets: torch.Tensor | None = None,  # [R] int64, absolute position of the first draft
    final_draw: str = "race",  # "race" (Exp(1) noise) or "inverse_cdf" (one uniform per depth)
    validate: bool = True,
) -> VerifyResult:
    """Verify one draft tree per request; returns the committed tokens and the accepted path.

    D is the deepest node's depth. Result: accepted [R] (depth reached), tokens [R, D+1]
    (path tokens then the bonus), num_tokens = accepted + 1, path [R, D+1] (root 0, then the
    accepted nodes; -1 padded). Randomness as in :func:`dspec_cli.runtime.verify.verify_chain`.
    ``draft_probs`` (methods "sampled" and "traversal", required there): row of node v = the
    distribution v's children were drawn from (without replacement, in node order); rows of
    leaves are ignored. The rows are checked (with ``validate``, their values too, in one host
    read), then padded into :func:`verify_tree_grid`'s implementation.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if final_draw not in ("race", "inverse_cdf"):
        raise ValueError(f"final_draw: expected 'race' or 'inverse_cdf', got {final_draw!r}")
    if final_draw == "inverse_cdf" and noise is not None:
        raise ValueError("final_draw: 'inverse_cdf' draws with uniforms; give no noise")
    checks.tensor("target_probs", target_probs, dim=2, kind="float")
    device, vocab = target_probs.device, target_probs.shape[1]
    checks.tensor("num_nodes", num_nodes, dim=1, kind="int", device=device)
    checks.tensor("tree_tokens", tree_tokens, dim=1, kind="int", device=device)
    checks.tensor("tree_parents", tree_parents, dim=1, kind="int", device=device)
    checks.shape("tree_parents", tree_parents, tuple(tree_tokens.shape))
    R = num_nodes.numel()
    if (draft_probs is None) == (method in SAMPLED_METHODS):
        raise ValueError(f"draft_probs: required by methods {SAMPLED_METHODS} and only used by them")
    if draft_probs is not None:
        checks.tensor("draft_probs", draft_probs, dim=2, kind="float", device=device)
        checks.shape("draft_probs", draft_probs, tuple(target_probs.shape))
    if uniforms is not None:
        if method == "match":
            raise ValueError("uniforms: per-node coins are not used by method 'match'")
        checks.tensor("uniforms", uniforms, dim=1, kind="float", device=device)
        checks.shape("uniforms", uniforms, tuple(tree_tokens.shape))
    if noise is not None:
        checks.tensor("noise", noise, dim=3, kind="float", device=device)
    checks.rng_keys(seeds, offsets, R, device)

    c = checks.Checks(device)
    total_i, widest_i = checks.lengths(c, "num_nodes", num_nodes, validate)
    if validate:
        checks.prob_rows(c, "target_probs", target_probs)
        checks.token_range(c, "tree_tokens", tree_tokens, vocab)
        if uniforms is not None:
            checks.open_unit(c, "uniforms", uniforms)
        if noise is not None:
            checks.positive_finite(c, "noise", noise)
        if draft_probs is not None:
            c.require("draft_probs", (torch.isfinite(draft_probs) & (draft_probs >= 0)).all(), "must be finite and >= 0")
    values = c.run()
    total, widest = int(values[total_i]), int(values[widest_i])
    if tree_tokens.numel() != total:
        raise ValueError(f"tree_tokens: has {tree_tokens.numel()} entries but num_nodes sums to {total}")
    if target_probs.shape[0] != total + R:
        raise ValueError(f"target_probs: has {target_probs.shape[0]} rows, expected Σ(num_nodes + 1) = {total + R}")

    # the rows padded into the grid form (N columns of nodes, N + 1 target rows per request)
    num_nodes, N = num_nodes.long(), max(widest, 1)
    parents = to_grid(tree_parents.long(), num_nodes, N, -1)
    c = checks.Checks(device)
    if validate and total:
        real = torch.arange(N, device=device) < num_nodes[:, None]
        ok = (parents >= 0) & (parents <= torch.arange(N, device=device))
        c.require("tree_parents", (ok | ~real).all(), "parent of node i must lie in [0, i) (parents first)")
    tree = Tree(to_grid(tree_tokens.long(), num_nodes, N), parents)
    depth_i = c.stat(tree.depths().max())
    fanout_i = c.stat(tree.fanout())
    values = c.run()
    depth, fanout = int(values[depth_i]), int(values[fanout_i])
    if noise is not None:
        checks.shape("noise", noise, (R, depth + 1, vocab))
    coins = None if method == "match" else _node_coins(
        tree, None if uniforms is None else to_grid(uniforms.double(), num_nodes, N, 0.5), seeds, offsets, generator)
    q = None if draft_probs is None else to_grid(draft_probs, num_nodes + 1, N + 1)
    draw = _depth_draw(final_draw, noise, seeds, offsets, generator, R, vocab, device)
    return _walk(method, to_grid(target_probs, num_nodes + 1, N + 1), q, tree, depth, fanout, coins, draw)


def verify_tree_grid(
    target_probs: torch.Tensor,  # [R, N+1, V]: the root's row, then one per column
    tree_tokens: torch.Tensor,  # [R, N]
    tree_parents: torch.Tensor,  # [R, N] local parent index (0 = root), -1: not a node
    *,
    depth: int,  # >= the deepest node's depth
    fanout: int = 0,  # >= the most children of any node (methods "recursive" and "sampled")
    method: str = "match",
    draft_probs: torch.Tensor | None = None,  # sampled, traversal: [R, N+1, V]
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64
    final_draw: str = "race",
) -> VerifyResult:
    """:func:`verify_tree` over padded rows with host-known bounds on depth and fan-out: no host
    reads (shapes are checked on the host, values are not). Counter-based randomness only.

    The nodes of a row are a prefix of its columns (the columns after them have parent -1). This
    is the one implementation: :func:`verify_tree` pads its ragged rows into it, with the same
    coins (salt NODE_SALT + local index) and target draws, so a row's outcome does not depend on
    the padding and the exactness arguments above carry over unchanged. The loops over depth and siblings run to the host bounds instead of stopping when
    every walk has (the remaining iterations change nothing on stopped rows)."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if final_draw not in ("race", "inverse_cdf"):
        raise ValueError(f"final_draw: expected 'race' or 'inverse_cdf', got {final_draw!r}")
    checks.tensor("target_probs", target_probs, dim=3, kind="float")
    device = target_probs.device
    checks.tensor("tree_tokens", tree_tokens, dim=2, kind="int", device=device)
    checks.tensor("tree_parents", tree_parents, dim=2, kind="int", device=device)
    R, N = tree_tokens.shape
    vocab = target_probs.shape[2]
    checks.shape("tree_parents", tree_parents, (R, N))
    checks.shape("target_probs", target_probs, (R, N + 1, vocab))
    if (draft_probs is None) == (method in SAMPLED_METHODS):
        raise ValueError(f"draft_probs: required by methods {SAMPLED_METHODS} and only used by them")
    if draft_probs is not None:
        checks.shape("draft_probs", draft_probs, (R, N + 1, vocab))
    checks.rng_keys(seeds, offsets, R, device)
    tree = Tree(tree_tokens.long(), tree_parents.long())
    coins = None if method == "match" else _node_coins(tree, None, seeds, offsets, None)
    draw = _depth_draw(final_draw, None, seeds, offsets, None, R, vocab, device)
    return _walk(method, target_probs, draft_probs, tree, depth, fanout, coins, draw)


def _walk(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tree: Tree, depth: int,
          fanout: int, coins: torch.Tensor | None, draw) -> VerifyResult:
    """The one tree verification, on padded rows (inputs checked): target_probs, draft_probs
    [R, N+1, V], coins [R, N] (None for "match"), ``draw`` from :func:`_depth_draw`."""
    probs = target_probs.flatten(0, 1)
    if method == "match":
        return _match(probs, tree, depth, draw)
    assert coins is not None  # every rule but "match" has a coin per node
    if method == "recursive":
        return _recursive(probs, tree, depth, fanout, coins, draw)
    assert draft_probs is not None  # checked by the callers
    if method == "sampled":
        return _sampled(probs, draft_probs.flatten(0, 1), tree, depth, fanout, coins, draw)
    return traversal.walk(probs, draft_probs.flatten(0, 1), tree, depth, coins, draw)


def _depth_draw(final_draw: str, noise, seeds, offsets, generator, R: int, vocab: int, device):
    """draw(d, weights [R, V]) -> tokens [R]: the target draw at depth d, by the exponential race
    with noise [R, V] drawn lazily (or row d of the given noise [R, D+1, V]), or by the inverse
    CDF with one uniform per row (the same distribution without a vocabulary-wide noise vector:
    cheaper on a CPU). seeds, offsets: [R] int64 or None."""
    if final_draw == "inverse_cdf":
        if seeds is not None:
            return lambda d, w: sample_inverse_cdf(w, uniform(seeds, offsets + d, NOISE_SALT))
        return lambda d, w: sample_inverse_cdf(w, torch_uniform((R,), generator=generator, device=device))
    if noise is not None:
        return lambda d, w: sample_from_probs(w, noise[:, d].float())
    if seeds is not None:
        return lambda d, w: sample_from_probs(w, exponential(seeds, offsets + d, vocab, NOISE_SALT))
    return lambda d, w: sample_from_probs(w, torch_exponential((R, vocab), generator=generator, device=device))


def _node_coins(tree: Tree, uniforms, seeds, offsets, generator) -> torch.Tensor:
    """Coins [R, N] (one per node, padded): ``uniforms`` [R, N] as given, else node i at (seed,
    offset) ([R] int64 each) with salt NODE_SALT + i, else the generator."""
    if uniforms is not None:
        return uniforms
    if seeds is not None:
        return uniform(seeds[:, None], offsets[:, None], NODE_SALT + tree.local)
    return torch_uniform(tree.valid.shape, generator=generator, device=tree.valid.device)


def _match(target_probs, tree: Tree, depth: int, draw) -> VerifyResult:  # target_probs [Σ(N_r+1), V]
    R, device = tree.valid.shape[0], tree.valid.device
    tokens, path = outputs(R, depth, device)
    cur = torch.zeros(R, dtype=torch.long, device=device)  # current node (local index)
    active = torch.ones(R, dtype=torch.bool, device=device)
    accepted = torch.zeros_like(cur)
    for d in range(depth + 1):
        if d and all_stopped(active):
            break
        y = draw(d, target_probs.index_select(0, tree.p_start + cur).float())  # [R]
        tokens[:, d] = torch.where(active, y, -1)
        path[:, d] = torch.where(active, cur, -1)
        hit = (tree.parents == cur[:, None]) & (tree.tokens == y[:, None])  # [R, M]
        found = hit.any(1) & active
        cur = torch.where(found, hit.long().argmax(1) + 1, cur)
        accepted += found
        active = found
    return VerifyResult(accepted, tokens, accepted + 1, path)


def _recursive(target_probs, tree: Tree, depth: int, fanout: int, coins, draw) -> VerifyResult:
    """target_probs [Σ(N_r+1), V], coins [R, M]."""
    def begin(rows):
        p = target_probs.index_select(0, rows).float()  # [R, V]
        return p, p  # (p, residual p' unnormalised)

    def child(state, x):
        p, res = state
        p_x = res.gather(1, x[:, None]).squeeze(1)
        return reference.acceptance_prob(p_x, res.sum(-1)), lambda: (p, res.scatter(1, x[:, None], 0.0))

    def final(d, state):
        p, res = state
        return draw(d, torch.where((res > 0).any(-1, keepdim=True), res, p))

    return rejection_walk(tree, depth, fanout, coins, begin, child, final)


def sibling_accept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The acceptance probability [R] float64 of child x [R] under recursive rejection sampling
    against residuals p', q' [R, V] (unnormalised): min(1, p̂'(x) / q̂'(x)), or p̂'(x) for a child
    outside q̂''s support (verified as a one-hot draft). Module-level (looked up at call time),
    as :func:`sibling_reject`, so tests can swap in biased versions."""
    p_x = p.gather(1, x[:, None]).squeeze(1).double() / mass(p)
    q_x = q.gather(1, x[:, None]).squeeze(1).double() / mass(q)
    return reference.acceptance_prob(p_x, torch.where(q_x > 0, q_x, 1.0))


def sibling_reject(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p', q') [R, V] after child x [R] was rejected: p' ← max(p̂' − q̂', 0), with q̂' := δ_x for
    a child outside q̂''s support; q' ← q̂' with x zeroed."""
    p_hat, q_hat = normalised(p), normalised(q)
    q_eff = q_hat
    outside = q_hat.gather(1, x[:, None]).squeeze(1) <= 0
    if not reads_free(outside) or bool(outside.any()):  # rare; the check is a free read on a CPU
        one_hot = torch.zeros_like(q_hat).scatter_(1, x[:, None], 1.0)
        q_eff = torch.where(outside[:, None], one_hot, q_hat)
    return reference.residual(p_hat, q_eff), q_hat.scatter(1, x[:, None], 0.0)


def _sampled(target_probs, draft_probs, tree: Tree, depth: int, fanout: int, coins, draw) -> VerifyResult:
    """target_probs, draft_probs [Σ(N_r+1), V], coins [R, M]."""
    def begin(rows):
        p = target_probs.index_select(0, rows).float()  # [R, V]
        return p, p, draft_probs.index_select(0, rows).float()  # (p, residuals p', q')

    def child(state, x):
        p, res_p, res_q = state
        return sibling_accept(res_p, res_q, x), lambda: (p, *sibling_reject(res_p, res_q, x))

    def final(d, state):
        p, res_p, _ = state
        return draw(d, torch.where((res_p > 0).any(-1, keepdim=True), res_p, p))

    return rejection_walk(tree, depth, fanout, coins, begin, child, final)
