"""Simulation: many independent requests through plain or multi-round speculative decoding
of toy models at once (Python loops over rounds and draft positions only), returning the
committed tokens to compare with :func:`sample_target`; every verifier result is checked for
its structural invariants on the way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dspec_cli.core.types import PAD, DraftTree, VerifyResult
from dspec_cli.runtime.verify import verify_chain, verify_tree
from dspec_cli.runtime.verify.tree import SAMPLED_METHODS
from dspec_cli.testing.policies import LengthPolicy
from dspec_cli.testing.toy import ToyDrafter, ToyLM, sample_categorical


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
    out = torch.full((num_requests, num_tokens), PAD, dtype=torch.long)
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
    node_tok = torch.cat([torch.full((R, 1), PAD), tree.tokens], 1)  # [R, N+1]; node 0 = root
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
    if bool((~valid & (tokens != PAD)).any()):
        raise AssertionError(f"tokens past num_tokens must be padded with PAD ({PAD})")



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
    return DraftTree(tokens=tokens_t.masked_fill(pad, PAD), parents=parents_t.masked_fill(pad, PAD), num_nodes=num_nodes)


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
            tree = tree_policy(dataclasses.replace(tree, parents=tree.parents.masked_fill(pad, PAD),
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

