"""Traversal verification of sampled draft trees (``verify_tree(method="traversal")``).

For trees whose siblings are a sequential sample without replacement from a draft distribution
q_v (as for ``"sampled"``, :mod:`dspec_cli.runtime.verify.tree`). The idea is Weng et al.,
"Traversal Verification for Speculative Tree Decoding" (2025, arXiv 2505.12398, §3): decide on
whole root-to-node sequences, leaves first, as block verification (Sun et al. 2025, arXiv
2403.10444) does for a chain, instead of accepting token by token from the root. The rule below
is our derivation of that idea for siblings drawn without replacement, with its proof.

The rule, as a procedure over the tree in post-order (a node's children in draw order, each
with its whole subtree, then the node itself). Every node v has a weight ρ_v ∈ [0, 1] (ρ = 1 at
the root) and, while its children are processed, a sub-probability measure ν over the
vocabulary of mass N, starting at ν = ρ_v·p_v (p_v: the target's next-token distribution after
v), and the proposal q' = q_v. For each child x, in draw order:

* x gets the weight ρ_x = min(1, ν(x) / q̂'(x)) (hats: normalised; a child outside q̂''s support
  can only be a deterministic choice and is verified as a one-hot draft, q̂' := δ_x) and its
  subtree is processed; if it passes, v passes through x and the procedure ends;
* if it fails: r = max(ν − q̂', 0), Z = Σr, ν ← r / (1 − N + Z), N ← Z / (1 − N + Z), q' ← q̂'
  with x removed, and the next child is tried.

When every child has failed, v stops with probability h_v = N (the accepted path ends at v and
the next token is drawn from ν / N) and otherwise fails. The root keeps N = 1 and always stops.
At N = 1 a child's step is recursive rejection sampling ("sampled": ρ_x = min(1, p̂'(x)/q̂'(x)),
ν the normalised residual), so both rules agree on the first token; on a chain the rule is
block verification. Below the root a child accepted with ρ_x < 1 hands its deficit to its own
subtree instead of ending the path there.

Why it is exact. Claim: with any ν of mass N <= 1 at v and any proposal q' for the children
still to come, the rest of v's processing passes with next token y (an accepted child y or the
stop token y) with probability ν(y). By induction on the children left: with none, v stops with
probability N and draws y from ν / N. Otherwise the next child x ~ q̂' (a without-replacement
draw given the earlier ones; the coins are independent of the drafts) passes, by induction
over the tree's height applied to x's subtree (whose ν starts with mass ρ_x), with probability
ρ_x given x, so P(x = y, x passes) = q̂'(y) min(1, ν(y)/q̂'(y)) = min(q̂'(y), ν(y)). It fails with
probability 1 − Σ min(q̂', ν) = 1 − N + Z; given that, the rest runs with ν' = r / (1 − N + Z)
(mass <= 1, the same whatever x was) and, by the inner induction, passes with next token y with
probability ν'(y). Summing: min(q̂'(y), ν(y)) + max(ν(y) − q̂'(y), 0) = ν(y). At the root the
first committed token is therefore distributed as p_root, and given that the path goes through
x, the procedure inside x's subtree, conditioned on passing, emits its next token with
probability ρ_x·p_x(y) / ρ_x = p_x(y): by induction over depth every committed token follows
the target's conditional distribution. As for "sampled", the number of children of a node may
depend on anything drafted before them, never on their values.

Computation (vectorised over requests). The weights and stop probabilities depend on the drafts
only, so a forward pass in node order (parents first) computes every ρ_v, h_v and final ν_v
(one residual per node: the extra work over "sampled", which builds residuals only after a
rejection on the walk's path). A backward pass gives every subtree's pass probability π_v =
1 − (1 − h_v) Π_children (1 − π_c). The post-order outcome is then drawn top-down with one coin
per node: from the current node the walk enters the first child c (in draw order) whose coin is
below e_c = π_c / (1 − (1 − π_c) L_c), where L_c = (1 − h_v) Π_{later siblings s} (1 − π_s) is the
chance that everything after c fails (e_c is the probability that c's subtree passes given that
v passes and the earlier siblings failed); with no such child the next token is drawn from v's
final ν. One target draw per depth, as the other walks.

``proposal``, ``child_weight``, ``rescale`` and ``enter_probs`` are looked up at call time, so
tests can swap in biased versions.
"""

from __future__ import annotations

import torch

from dspec_cli.core.host import reads_free
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify.tree_walk import Tree, all_stopped, normalised, outputs


def proposal(q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For child x [R] drawn from the proposal q [R, V] (unnormalised): the distribution it counts
    as drawn from, q̂' or δ_x where x lies outside q̂''s support (a one-hot draft), and the
    proposal of the next sibling, q̂' with x removed (both [R, V])."""
    q_hat = normalised(q)
    q_next = q_hat.scatter(1, x[:, None], 0.0)
    outside = q_hat.gather(1, x[:, None]).squeeze(1) <= 0
    if reads_free(outside) and not bool(outside.any()):  # the usual case; a free read on a CPU
        return q_hat, q_next
    one_hot = torch.zeros_like(q_hat).scatter_(1, x[:, None], 1.0)
    return torch.where(outside[:, None], one_hot, q_hat), q_next


def child_weight(
    nu: torch.Tensor,  # [R, V] the parent's measure
    q_x: torch.Tensor,  # [R, V] the distribution x was drawn from
    x: torch.Tensor,  # [R] long
) -> torch.Tensor:
    """ρ_x = min(1, ν(x) / q(x)) [R] float64 for child x [R], with ν [R, V] the parent's measure
    and q [R, V] the distribution x was drawn from (:func:`proposal`)."""
    q_at = q_x.gather(1, x[:, None]).squeeze(1).double()
    nu_at = nu.gather(1, x[:, None]).squeeze(1).double()
    return torch.minimum(nu_at / torch.where(q_at > 0, q_at, 1.0), torch.ones_like(nu_at))


def rescale(
    r: torch.Tensor,  # [R, V] the residual
    n: torch.Tensor,  # [R] float64 the measure's mass
    z: torch.Tensor,  # [R] float64 the residual's mass
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ν', N') after a failure: r [R, V] / (1 − N + Z) and Z / (1 − N + Z) [R] float64, for the
    measure's mass N [R] and the residual's mass Z [R] (both float64). A vanishing denominator
    (N = 1 and Z = 0: the failure had probability 0) leaves r and gives N' = 0."""
    denom = 1.0 - n + z
    ok = denom > 0
    safe = torch.where(ok, denom, 1.0)
    return r / safe.float()[:, None], torch.where(ok, z / safe, 0.0)


def enter_probs(
    pi: torch.Tensor,  # [...] float64 pass probability
    later: torch.Tensor,  # [...] float64 chance that everything after fails
) -> torch.Tensor:
    """e = π / (1 − (1 − π)·L) [...] float64: the chance that a child's subtree passes given that
    its parent passes and its earlier siblings failed, from its pass probability π and the chance
    L that everything after it fails (both [...] float64)."""
    denom = 1.0 - (1.0 - pi) * later
    return torch.where(denom > 0, pi / torch.where(denom > 0, denom, 1.0), 1.0)


def _forward(target_probs: torch.Tensor, draft_probs: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """From target_probs, draft_probs [Σ(N_r+1), V]: every node's final measure ν (flat rows
    [Σ(N_r+1) + 1, V], like target_probs plus a row for padded nodes' writes) and stop
    probability h [R, M+1] float64 (the root's 1)."""
    M = tree.valid.shape[1]
    rows = target_probs.shape[0]
    nu = torch.cat([target_probs.float(), target_probs.new_zeros(1, target_probs.shape[1]).float()])  # ν_v = ρ_v·p_v
    q = torch.cat([draft_probs.float(), nu.new_zeros(1, nu.shape[1])])  # q'_v, children removed as processed
    n = torch.ones(rows + 1, dtype=torch.float64, device=nu.device)  # N_v
    for i in range(1, M + 1):
        live = tree.valid[:, i - 1]  # [R]
        if all_stopped(live):
            break
        parent = tree.p_start + tree.parents[:, i - 1].clamp(min=0)  # [R] flat rows
        own = torch.where(live, tree.p_start + i, rows)  # [R] node i's flat row (padding: the spare row)
        x = tree.tokens[:, i - 1].clamp(min=0)
        nu_v, n_v = nu.index_select(0, parent), n.index_select(0, parent)
        q_x, q_next = proposal(q.index_select(0, parent), x)
        rho = child_weight(nu_v, q_x, x)  # [R]
        r = (nu_v - q_x).clamp(min=0)  # the residual if x fails
        nu_next, n_next = rescale(r, n_v, r.sum(-1, dtype=torch.float64))
        target = torch.where(live, parent, rows)
        nu.index_copy_(0, target, nu_next)
        q.index_copy_(0, target, q_next)
        n.index_copy_(0, target, n_next)
        nu.index_copy_(0, own, rho.float()[:, None] * nu.index_select(0, own))
        n.index_copy_(0, own, rho)
    local = torch.arange(M + 1, device=nu.device)
    h = n[torch.where(local <= tree.valid.sum(1, keepdim=True), tree.p_start[:, None] + local, rows)]  # [R, M+1]
    h[:, 0] = 1.0
    return nu, h


def _enter(tree: Tree, h: torch.Tensor) -> torch.Tensor:
    """e [R, M+1] float64 for every node (column 0, the root, unused) from the stop probabilities
    h [R, M+1]: pass probabilities π bottom-up, then :func:`enter_probs`."""
    R, M = tree.valid.shape
    fail = torch.where(torch.cat([tree.valid.new_ones(R, 1), tree.valid], 1), 1.0 - h, 1.0)  # [R, M+1]
    later = torch.zeros_like(fail)
    for i in range(M, 0, -1):  # children after parents: a node's children are done before it
        parent = tree.parents[:, i - 1].clamp(min=0)[:, None]  # [R, 1]
        rest = fail.gather(1, parent)  # [R, 1]: (1 − h_v) Π over the later siblings
        later[:, i : i + 1] = rest
        fail.scatter_(1, parent, torch.where(tree.valid[:, i - 1 : i], rest * fail[:, i : i + 1], rest))
    return enter_probs(1.0 - fail, later)


def walk(target_probs: torch.Tensor, draft_probs: torch.Tensor, tree: Tree, depth: int, coins: torch.Tensor,
         draw) -> VerifyResult:
    """Traversal verification: target_probs, draft_probs [Σ(N_r+1), V], coins [R, M] one per
    node, draw(d, weights [R, V]) -> [R] the target draw at depth d."""
    R, device = tree.valid.shape[0], tree.valid.device
    nu, h = _forward(target_probs, draft_probs, tree)
    passes = tree.valid & (coins < _enter(tree, h)[:, 1:])  # [R, M]: the child's subtree would be entered
    tokens, path = outputs(R, depth, device)
    cur = torch.zeros(R, dtype=torch.long, device=device)
    active = torch.ones(R, dtype=torch.bool, device=device)
    accepted = torch.zeros_like(cur)
    for d in range(depth + 1):
        if d and all_stopped(active):
            break
        hit = passes & (tree.parents == cur[:, None])  # [R, M]
        moved = hit.any(1) & active
        nxt = torch.where(moved, hit.long().argmax(1) + 1, cur)  # the first such child in draw order
        at = tree.p_start + cur
        final_nu = nu.index_select(0, at)
        y = draw(d, torch.where((final_nu > 0).any(-1, keepdim=True), final_nu, target_probs.index_select(0, at).float()))
        node_tok = tree.tokens.gather(1, (nxt - 1).clamp(min=0)[:, None]).squeeze(1)
        tokens[:, d] = torch.where(moved, node_tok, torch.where(active, y, -1))
        path[:, d] = torch.where(active, cur, -1)
        cur = nxt
        accepted += moved
        active = moved
    return VerifyResult(accepted, tokens, accepted + 1, path)
