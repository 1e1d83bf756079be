"""Traversal verification (``verify_tree(method="traversal")``): the walk's law on fixed trees
against a python oracle of the post-order procedure of the module docstring, chains against
block verification, T = 0, and bad input. Chi-square tests over drafted trees are in
test_lossless_verify.py."""

import pytest
import torch
from test_verify_tree import _bad_tree, sampled_case

from dspec_cli import testing as T
from dspec_cli.core.sampling import logits_to_probs
from dspec_cli.runtime.verify import verify_chain, verify_tree


def post_order_law(p, q, tokens, parents):
    """Exact law {(stop node, token): probability} of the post-order procedure for one tree
    (nodes 1..N, p and q rows 0..N, float64)."""
    p, q = p.double(), q.double()
    kids = {v: [i for i in range(1, len(tokens) + 1) if parents[i - 1] == v] for v in range(len(tokens) + 1)}

    def process(v, rho):  # the passing outcomes of v's subtree given its drafts: [(prob, node, token)]
        nu, n, prop = rho * p[v], rho, q[v].clone()
        out, fail = [], 1.0
        for c in kids[v]:
            x = tokens[c - 1]
            q_hat = prop / prop.sum() if prop.sum() > 0 else prop
            if q_hat[x] <= 0:
                q_hat = torch.zeros_like(q_hat).index_fill(0, torch.tensor([x]), 1.0)
            sub = process(c, min(1.0, float(nu[x] / q_hat[x])))
            out += [(fail * pr, node, y) for pr, node, y in sub]
            fail *= 1 - sum(pr for pr, _, _ in sub)
            r = (nu - q_hat).clamp(min=0)
            z = float(r.sum())
            denom = 1 - n + z
            nu, n = (r / denom, z / denom) if denom > 0 else (r, 0.0)
            prop = (prop / prop.sum() if prop.sum() > 0 else prop).index_fill(0, torch.tensor([x]), 0.0)
        return out + [(fail * float(nu[y]), v, y) for y in range(len(nu)) if nu[y] > 0]

    law = {}
    for pr, node, y in process(0, 1.0):
        law[(node, y)] = law.get((node, y), 0.0) + pr
    return law


def _traversal(probs, q, tokens, parents, n, seed):
    """verify_tree(method="traversal") on n copies of one tree."""
    return verify_tree(probs.repeat(n, 1), tokens.repeat(n), parents.repeat(n), torch.full((n,), tokens.numel()),
                       method="traversal", draft_probs=q.repeat(n, 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sizes,V,seed", [([6], 5, 1), ([9], 4, 2), ([12], 6, 3), ([5], 3, 4)])
def test_walk_law_matches_post_order_procedure(sizes, V, seed):
    """Given the drafts, the stop node and the next token follow the post-order procedure's law
    (the walk draws it top-down from the subtrees' pass probabilities)."""
    probs, q, tokens, parents, _ = sampled_case(sizes, V, seed)
    law = post_order_law(probs, q, tokens.tolist(), parents.tolist())
    assert abs(sum(law.values()) - 1) < 1e-9
    result = _traversal(probs, q, tokens, parents, 40_000, seed)
    keys = sorted(law)
    index = {k: i for i, k in enumerate(keys)}
    stop = result.path.gather(1, result.accepted[:, None]).squeeze(1)
    final = result.tokens.gather(1, result.accepted[:, None]).squeeze(1)
    samples = torch.tensor([index.get((s, y), len(keys)) for s, y in zip(stop.tolist(), final.tolist(), strict=True)])
    T.assert_same_distribution(samples, torch.tensor([law[k] for k in keys] + [0.0]), alpha=1e-4,
                               name="traversal walk vs post-order law")


def test_chain_law_is_block_verification():
    """On a chain the rule is block verification: P(τ = k) = h_k Π_{j>k} (1 − h_j)."""
    g = torch.Generator().manual_seed(5)
    V, gamma, n = 6, 4, 40_000
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    x = torch.tensor([int(torch.multinomial(q[k], 1, generator=g)) for k in range(gamma)])
    parents = torch.arange(gamma)
    law = post_order_law(p, q, x.tolist(), parents.tolist())
    depth_law = torch.zeros(gamma + 1, dtype=torch.float64)
    for (node, _), pr in law.items():
        depth_law[node] += pr
    tree = _traversal(p, q, x, parents, n, 6)
    chain = verify_chain(p.repeat(n, 1), x.repeat(n), q[:gamma].repeat(n, 1), torch.full((n,), gamma), method="block",
                         generator=torch.Generator().manual_seed(7))
    for result in (tree, chain):
        T.assert_same_distribution(result.accepted, depth_law, alpha=1e-4, name="accepted drafts")


def test_temperature_zero_is_greedy_path_matching():
    """One-hot p and q (later siblings outside q's support, verified as one-hot drafts): the
    accepted path follows the target's argmax."""
    g = torch.Generator().manual_seed(10)
    V = 7
    tokens, parents = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 3])
    for target in ([1, 3, 5, 6], [2, 4]):  # the argmax path: node tokens, then the bonus token
        logits = torch.randn(6, V, generator=g)
        node = 0
        for tok in target:
            logits[node, tok] = 9.0
            node = next((i + 1 for i in range(5) if parents[i] == node and tokens[i] == tok), 0)
        p = logits_to_probs(logits, 0.0)
        q = logits_to_probs(torch.randn(6, V, generator=g), 0.0)
        result = verify_tree(p, tokens, parents, torch.tensor([5]), method="traversal", draft_probs=q,
                             generator=torch.Generator().manual_seed(11))
        assert result.tokens[0, : int(result.num_tokens[0])].tolist() == target


@pytest.mark.parametrize("changes", [dict(method="traversal"),
                                     dict(method="traversal", draft_probs=torch.full((6, 5), 0.2))])
def test_bad_input_names_draft_probs(changes):
    with pytest.raises(ValueError, match="^draft_probs"):
        verify_tree(**_bad_tree(**changes))
