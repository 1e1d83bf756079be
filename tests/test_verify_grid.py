"""The padded (``*_grid``) verifiers the engine's static round runs give, row for row, what the
ragged verifiers give with the same randomness, whatever the padding holds: every chain rule
(token, block; race or inverse CDF) and every tree rule (match, recursive, sampled, traversal)."""

from __future__ import annotations

import pytest
import torch

from dspec_cli.core.sampling import CounterNoise, exponential
from dspec_cli.runtime.verify import (
    verify_chain,
    verify_chain_grid,
    verify_greedy,
    verify_greedy_grid,
    verify_tree,
    verify_tree_grid,
)

V = 11


def _probs(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, V, generator=gen) * 2, -1)


def _chains(seed: int, R: int = 5, W: int = 4):
    gen = torch.Generator().manual_seed(seed)
    ell = torch.tensor([W, 0, 2, 1, W - 1][:R])
    p, q = _probs(gen, R, W + 1), _probs(gen, R, W)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(R, W)
    for r in range(R):  # make some drafts the target's favourite, so prefixes are accepted
        drafts[r, : ell[r] // 2] = p[r, : ell[r] // 2].argmax(-1)
    u = torch.rand(R, W, generator=gen, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    keep = torch.arange(W)[None, :] < ell[:, None]  # [R, W]: the rows' real drafts
    ragged = dict(p=torch.cat([p[r, : ell[r] + 1] for r in range(R)]), drafts=drafts[keep], q=q[keep], u=u[keep])
    return p, q, drafts, ell, u, ragged


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("final", ["race", "inverse_cdf"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_chain_grid_equals_ragged(method, final, one_hot):
    for seed in range(20):
        p, q, drafts, ell, u, rg = _chains(seed)
        R = ell.numel()
        seeds, offsets = torch.arange(R) + 7, torch.full((R,), 40)
        fin = dict(final_uniforms=u[:, 0].clone()) if final == "inverse_cdf" else {}
        grid_q, ragged_q = (None, None) if one_hot else (q, rg["q"])
        noise = None if fin else CounterNoise(seeds, offsets, 3)
        got = verify_chain_grid(p, drafts, grid_q, ell, method=method, uniforms=u,
                                **(fin or dict(noise=noise)))  # fmt: skip
        want = verify_chain(rg["p"], rg["drafts"], ragged_q, ell, method=method, uniforms=rg["u"], backend="torch",
                            **(fin or dict(noise=exponential(seeds, offsets, V, 3))))  # fmt: skip
        assert torch.equal(got.accepted, want.accepted), seed
        width = want.tokens.shape[1]
        assert torch.equal(got.tokens[:, :width], want.tokens), seed
        assert (got.tokens[:, width:] == -1).all()


def test_greedy_grid_equals_ragged():
    for seed in range(10):
        p, _, drafts, ell, _, rg = _chains(seed)
        got, want = verify_greedy_grid(p.log(), drafts, ell), verify_greedy(rg["p"].log(), rg["drafts"], ell)
        assert torch.equal(got.accepted, want.accepted)
        assert torch.equal(got.tokens[:, : want.tokens.shape[1]], want.tokens)


def _trees(seed: int, R: int = 4, N: int = 6):
    """Random trees (nodes a prefix of each row's N columns, parents first), drawn so that the
    target's favourite tokens are often among the children."""
    gen = torch.Generator().manual_seed(seed)
    nodes = torch.tensor([N, 3, 0, 5][:R])
    p, q = _probs(gen, R, N + 1), _probs(gen, R, N + 1)
    tokens = torch.randint(V, (R, N), generator=gen)
    parents = torch.full((R, N), -1)
    for r in range(R):
        for i in range(int(nodes[r])):
            parent = int(torch.randint(i + 1, (1,), generator=gen))
            parents[r, i] = parent
            tokens[r, i] = p[r, parent].argmax() if i % 2 == 0 else tokens[r, i]
    real = parents >= 0
    ragged = dict(p=torch.cat([p[r, : nodes[r] + 1] for r in range(R)]), q=torch.cat([q[r, : nodes[r] + 1] for r in range(R)]),
                  tokens=tokens[real], parents=parents[real])
    return p, q, tokens, parents, nodes, ragged


@pytest.mark.parametrize("method", ["match", "recursive", "sampled", "traversal"])
@pytest.mark.parametrize("final", ["race", "inverse_cdf"])
def test_tree_grid_equals_ragged(method, final):
    sampled = method in ("sampled", "traversal")
    for seed in range(15):
        p, q, tokens, parents, nodes, rg = _trees(seed)
        R, N = tokens.shape
        seeds, offsets = torch.arange(R) + 1, torch.full((R,), 100)
        got = verify_tree_grid(p, tokens, parents, depth=N, fanout=N, method=method, draft_probs=q if sampled else None,
                               seeds=seeds, offsets=offsets, final_draw=final)
        want = verify_tree(rg["p"], rg["tokens"], rg["parents"], nodes, method=method,
                           draft_probs=rg["q"] if sampled else None, seeds=seeds, offsets=offsets, final_draw=final)
        assert torch.equal(got.accepted, want.accepted), seed
        width = want.tokens.shape[1]
        assert torch.equal(got.tokens[:, :width], want.tokens), seed
        assert want.path is not None and got.path is not None
        assert torch.equal(got.path[:, :width], want.path), seed
