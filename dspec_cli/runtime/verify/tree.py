"""Tree verification (torch; vectorised over requests, a python loop over depth).

Request r has nodes 1..N_r (local indices; 0 is the root, i.e. the anchor row) with draft
tokens and parents (parent 0 = child of the root; parents precede children). Its target rows
are the root row, then one row per node in order: Σ(N_r + 1) rows in all.

Two lossless walks, both starting at the root:

* ``"match"`` (sample-and-match, DDTree / JetSpec): at the current node draw y from the
  target's p (exponential race, one noise vector per depth); move to the first child whose
  token is y, else stop. The last draw is the bonus token. Every committed token is a target
  sample from the right conditional, so it is exact at any temperature and whatever the
  tree; at T = 0 it is greedy path matching.
* ``"recursive"`` (SpecInfer / EAGLE-2 recursive rejection for deterministic tree drafts):
  at the current node try its children in order, accepting child x with probability
  p'(x) / Σp' where p' starts at p and has each rejected child's token zeroed; if none is
  accepted, draw the final token from p'. One coin per node, one noise vector per request.
  Exact when the tree is chosen deterministically from the drafter (q one-hot); it gives the
  same distribution as "match" (both accept child x with probability p(x) overall).
"""

from __future__ import annotations

import torch

from dspec_cli.core.ragged import prefix_sums
from dspec_cli.core.sampling import (
    NODE_SALT,
    NOISE_SALT,
    exponential,
    sample_from_probs,
    torch_exponential,
    torch_uniform,
    uniform,
)
from dspec_cli.core.types import VerifyResult
from dspec_cli.runtime.verify import checks, reference

METHODS = ("match", "recursive")


class _Tree:
    """Padded per-request view [R, M] (M = max(max N_r, 1)) of the flattened tree."""

    def __init__(self, tokens, parents, num_nodes, total: int, widest: int):
        R, dev = num_nodes.numel(), num_nodes.device
        self.n_start = prefix_sums(num_nodes)[:-1]  # [R] first node of each request
        self.p_start = self.n_start + torch.arange(R, device=dev)  # [R] root row
        j = torch.arange(max(widest, 1), device=dev)
        self.valid = j < num_nodes[:, None]  # [R, M]
        self.flat = (self.n_start[:, None] + j).clamp(max=max(total - 1, 0))
        if total:
            self.tokens = torch.where(self.valid, tokens[self.flat], -1)
            self.parents = torch.where(self.valid, parents[self.flat], -1)
        else:
            self.tokens = self.parents = torch.full_like(self.flat, -1)
        self.local = j + 1  # [M] local index of padded column j

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


def verify_tree(
    target_probs: torch.Tensor,  # [Σ(N_r+1), V]
    tree_tokens: torch.Tensor,  # [ΣN_r]
    tree_parents: torch.Tensor,  # [ΣN_r] local parent index, 0 = root
    num_nodes: torch.Tensor,  # [R]
    *,
    method: str = "match",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # recursive: [ΣN_r] float64 coin per node
    noise: torch.Tensor | None = None,  # match: [R, D+1, V]; recursive: [R, V]
    seeds: torch.Tensor | None = None,  # [R] int64
    offsets: torch.Tensor | None = None,  # [R] int64, absolute position of the first draft
    validate: bool = True,
) -> VerifyResult:
    """Verify one draft tree per request; returns the committed tokens and the accepted path.

    D is the deepest node's depth. Result: accepted [R] (depth reached), tokens [R, D+1]
    (path tokens then the bonus), num_tokens = accepted + 1, path [R, D+1] (root 0, then the
    accepted nodes; -1 padded). Randomness as in :func:`dspec_cli.runtime.verify.verify_chain`.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    checks.tensor("target_probs", target_probs, dim=2, kind="float")
    device, vocab = target_probs.device, target_probs.shape[1]
    checks.tensor("num_nodes", num_nodes, dim=1, kind="int", device=device)
    checks.tensor("tree_tokens", tree_tokens, dim=1, kind="int", device=device)
    checks.tensor("tree_parents", tree_parents, dim=1, kind="int", device=device)
    checks.shape("tree_parents", tree_parents, tuple(tree_tokens.shape))
    R = num_nodes.numel()
    if uniforms is not None:
        if method != "recursive":
            raise ValueError("uniforms: per-node coins are only used by method='recursive'")
        checks.tensor("uniforms", uniforms, dim=1, kind="float", device=device)
        checks.shape("uniforms", uniforms, tuple(tree_tokens.shape))
    if noise is not None:
        checks.tensor("noise", noise, dim=3 if method == "match" else 2, kind="float", device=device)
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
    values = c.run()
    total, widest = int(values[total_i]), int(values[widest_i])
    if tree_tokens.numel() != total:
        raise ValueError(f"tree_tokens: has {tree_tokens.numel()} entries but num_nodes sums to {total}")
    if target_probs.shape[0] != total + R:
        raise ValueError(f"target_probs: has {target_probs.shape[0]} rows, expected Σ(num_nodes + 1) = {total + R}")

    tree = _Tree(tree_tokens.long(), tree_parents.long(), num_nodes.long(), total, widest)
    c = checks.Checks(device)
    if validate and total:
        ok = (tree.parents >= 0) & (tree.parents < tree.local)
        c.require("tree_parents", (ok | ~tree.valid).all(), "parent of node i must lie in [0, i) (parents first)")
    depth_i = c.stat(tree.depths().max())
    fanout_i = c.stat(tree.fanout())
    values = c.run()
    depth, fanout = int(values[depth_i]), int(values[fanout_i])
    if noise is not None:
        checks.shape("noise", noise, (R, depth + 1, vocab) if method == "match" else (R, vocab))

    if method == "match":
        return _match(target_probs, tree, depth, _depth_noise(noise, seeds, offsets, generator, R, vocab, device))
    coins, final_noise = _recursive_randomness(tree, uniforms, noise, seeds, offsets, generator, total, vocab)
    return _recursive(target_probs, tree, depth, fanout, coins, final_noise)


def _depth_noise(noise, seeds, offsets, generator, R: int, vocab: int, device):
    """Noise [R, V] for depth d, drawn lazily."""
    if noise is not None:
        return lambda d: noise[:, d].float()
    if seeds is not None:
        return lambda d: exponential(seeds, offsets + d, vocab, NOISE_SALT)
    return lambda d: torch_exponential((R, vocab), generator=generator, device=device)


def _recursive_randomness(tree: _Tree, uniforms, noise, seeds, offsets, generator, total: int, vocab: int):
    """Coins [R, M] (one per node, padded) and final-token noise [R, V]."""
    R, device = tree.valid.shape[0], tree.valid.device
    if uniforms is None:
        if seeds is not None:
            coins = uniform(seeds[:, None], offsets[:, None], NODE_SALT + tree.local)
        else:
            coins = torch_uniform(tree.valid.shape, generator=generator, device=device)
    else:
        coins = uniforms.double()[tree.flat] if total else torch.full_like(tree.valid, 0.5, dtype=torch.float64)
    if noise is None:
        if seeds is not None:
            noise = exponential(seeds, offsets, vocab, NOISE_SALT)
        else:
            noise = torch_exponential((R, vocab), generator=generator, device=device)
    return coins, noise.float()


def _outputs(R: int, depth: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((R, depth + 1), -1, dtype=torch.long, device=device)
    return tokens, torch.full_like(tokens, -1)


def _match(target_probs, tree: _Tree, depth: int, noise_at) -> VerifyResult:
    R, device = tree.valid.shape[0], tree.valid.device
    tokens, path = _outputs(R, depth, device)
    cur = torch.zeros(R, dtype=torch.long, device=device)  # current node (local index)
    active = torch.ones(R, dtype=torch.bool, device=device)
    accepted = torch.zeros_like(cur)
    for d in range(depth + 1):
        y = sample_from_probs(target_probs.index_select(0, tree.p_start + cur).float(), noise_at(d))  # [R]
        tokens[:, d] = torch.where(active, y, -1)
        path[:, d] = torch.where(active, cur, -1)
        hit = (tree.parents == cur[:, None]) & (tree.tokens == y[:, None])  # [R, M]
        found = hit.any(1) & active
        cur = torch.where(found, hit.long().argmax(1) + 1, cur)
        accepted += found
        active = found
    return VerifyResult(accepted, tokens, accepted + 1, path)


def _recursive(target_probs, tree: _Tree, depth: int, fanout: int, coins, noise) -> VerifyResult:
    R, device = tree.valid.shape[0], tree.valid.device
    tokens, path = _outputs(R, depth, device)
    cur = torch.zeros(R, dtype=torch.long, device=device)
    active = torch.ones(R, dtype=torch.bool, device=device)
    accepted = torch.zeros_like(cur)
    for d in range(depth + 1):
        p = target_probs.index_select(0, tree.p_start + cur).float()  # [R, V]
        res = p.clone()  # residual p' (unnormalised)
        kids = tree.parents == cur[:, None]  # [R, M]
        rank = kids.long().cumsum(1) - 1
        moved = torch.zeros_like(active)
        nxt = cur.clone()
        for j in range(fanout):
            pick = kids & (rank == j)
            tried = pick.any(1) & active & ~moved
            col = pick.long().argmax(1, keepdim=True)  # [R, 1]
            x = tree.tokens.gather(1, col).clamp(min=0)
            p_x = res.gather(1, x).squeeze(1)
            prob = reference.acceptance_prob(p_x, res.sum(-1))
            ok = tried & (coins.gather(1, col).squeeze(1) < prob)
            moved |= ok
            nxt = torch.where(ok, col.squeeze(1) + 1, nxt)
            res.scatter_(1, x, torch.where(tried & ~ok, 0.0, p_x)[:, None])
        final = sample_from_probs(torch.where((res > 0).any(-1, keepdim=True), res, p), noise)
        node_tok = tree.tokens.gather(1, (nxt - 1).clamp(min=0)[:, None]).squeeze(1)
        tokens[:, d] = torch.where(moved, node_tok, torch.where(active, final, -1))
        path[:, d] = torch.where(active, cur, -1)
        cur = nxt
        accepted += moved
        active = moved
    return VerifyResult(accepted, tokens, accepted + 1, path)
