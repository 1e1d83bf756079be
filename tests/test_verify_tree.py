"""Tree verification ("match", "recursive", "sampled"; "traversal" in test_verify_traversal.py):
edge cases, oracles and bad input."""

import pytest
import torch

from dspec_cli.core.sampling import logits_to_probs, torch_exponential, torch_uniform
from dspec_cli.runtime.verify import reference, verify_greedy, verify_tree

METHODS = ["match", "recursive"]


def random_trees(sizes, V, *, seed=0, branching=3):
    """Flattened random trees: node i's parent is uniform in [max(0, i - branching), i)."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents = [], []
    for n in sizes:
        for i in range(1, n + 1):
            parents.append(int(torch.randint(max(0, i - branching), i, (), generator=g)))
            tokens.append(int(torch.randint(0, V, (), generator=g)))
    num_nodes = torch.tensor(sizes, dtype=torch.long)
    total = int(num_nodes.sum())
    logits = torch.randn(total + len(sizes), V, generator=g) * 3
    return (
        torch.softmax(logits, -1),
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        num_nodes,
    )


def tree_depth(parents, sizes):
    out, start = 0, 0
    for n in sizes:
        d = [0]
        for i in range(n):
            d.append(d[int(parents[start + i])] + 1)
        out = max(out, max(d))
        start += n
    return out


def oracle(method, target_probs, tokens, parents, num_nodes, coins, noise):
    """Per-request python walk; returns (tokens, path) lists."""
    out, row, start = [], 0, 0
    for r, n in enumerate(num_nodes.tolist()):
        par = [None] + parents[start : start + n].tolist()
        tok = [None] + tokens[start : start + n].tolist()
        cur, toks, path, depth = 0, [], [0], 0
        while True:
            p = target_probs[row + cur].float()
            kids = [i for i in range(1, n + 1) if par[i] == cur]
            if method == "match":
                y = int((p / noise[r, depth]).argmax())
                nxt = next((i for i in kids if tok[i] == y), None)
                toks.append(y)
            else:
                res, nxt = p.clone(), None
                for i in kids:
                    px, mass = float(res[tok[i]]), float(res.sum())
                    prob = min(1.0, px / mass) if mass > 0 else float(px > 0)
                    if float(coins[start + i - 1]) < prob:
                        nxt = i
                        break
                    res[tok[i]] = 0
                if nxt is None:
                    toks.append(int(((res if (res > 0).any() else p) / noise[r, depth]).argmax()))
                else:
                    toks.append(tok[nxt])
            if nxt is None:
                break
            cur, depth = nxt, depth + 1
            path.append(cur)
        out.append((toks, path))
        row, start = row + n + 1, start + n
    return out


def as_lists(result):
    n = result.num_tokens.tolist()
    return [(t[:k], p[:k]) for t, p, k in zip(result.tokens.tolist(), result.path.tolist(), n, strict=True)]


def randomness(method, sizes, parents, V, seed):
    g = torch.Generator().manual_seed(seed)
    R, D = len(sizes), tree_depth(parents, sizes)
    if method == "match":
        return dict(noise=torch_exponential((R, D + 1, V), generator=g)), None
    coins = torch_uniform((sum(sizes),), generator=g)
    return dict(uniforms=coins, noise=torch_exponential((R, D + 1, V), generator=g)), coins


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sizes,V", [([0], 5), ([0, 0, 0], 9), ([6, 0, 12, 1], 7), ([30], 3), ([8] * 20, 3)])
def test_matches_oracle(method, sizes, V):
    probs, tokens, parents, num_nodes = random_trees(sizes, V, seed=sum(sizes) + V)
    rand, coins = randomness(method, sizes, parents, V, seed=V)
    result = verify_tree(probs, tokens, parents, num_nodes, method=method, **rand)
    D = tree_depth(parents, sizes)
    assert result.tokens.shape == result.path.shape == (len(sizes), D + 1)
    assert torch.equal(result.num_tokens, result.accepted + 1)
    cols = torch.arange(D + 1)
    assert (result.tokens[cols >= result.num_tokens[:, None]] == -1).all()
    assert (result.path[cols >= result.num_tokens[:, None]] == -1).all()
    assert as_lists(result) == oracle(method, probs, tokens, parents, num_nodes, coins, rand["noise"])


@pytest.mark.parametrize("method", METHODS)
def test_empty_trees_sample_from_root(method):
    probs, tokens, parents, num_nodes = random_trees([0, 0], 13, seed=1)
    noise = torch_exponential((2, 13), generator=torch.Generator().manual_seed(2))
    result = verify_tree(probs, tokens, parents, num_nodes, method=method, noise=noise[:, None])
    assert result.accepted.tolist() == [0, 0]
    assert result.path.tolist() == [[0], [0]]
    assert torch.equal(result.tokens[:, 0], (probs / noise).argmax(-1))


@pytest.mark.parametrize("method", METHODS)
def test_single_chain_tree_equals_greedy_chain(method):
    """At T = 0 a chain-shaped tree is verified exactly like verify_greedy."""
    g = torch.Generator().manual_seed(3)
    lengths = [0, 4, 7, 1, 3]
    V, R, total = 17, 5, sum(lengths)
    logits = torch.randn(total + R, V, generator=g)
    best = logits.argmax(-1)
    drafts, parents, row = [], [], 0
    for n in lengths:
        for k in range(n):
            follow = torch.rand((), generator=g) < 0.75
            drafts.append(int(best[row + k]) if follow else int(torch.randint(0, V, (), generator=g)))
            parents.append(k)
        row += n + 1
    drafts, parents, num = torch.tensor(drafts), torch.tensor(parents), torch.tensor(lengths)
    greedy = verify_greedy(logits, drafts, num)
    tree = verify_tree(logits_to_probs(logits, 0.0), drafts, parents, num, method=method, generator=g)
    assert torch.equal(tree.accepted, greedy.accepted)
    assert torch.equal(tree.tokens[:, : greedy.tokens.shape[1]], greedy.tokens)
    for r in range(R):
        assert tree.path[r, : int(tree.accepted[r]) + 1].tolist() == list(range(int(tree.accepted[r]) + 1))


@pytest.mark.parametrize("method", METHODS)
def test_wide_tree_greedy_takes_argmax_child(method):
    V, width = 64, 50
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(width + 2, V, generator=g)
    root_best = int(logits[0].argmax())
    others = [t for t in torch.randperm(V, generator=g).tolist() if t != root_best][: width - 1]
    children = others[:20] + [root_best] + others[20:]  # the argmax child is node 21 (row 21)
    tokens = children + [int(logits[21].argmax())]  # node 51, under node 21, matches its argmax
    parents = [0] * width + [21]
    result = verify_tree(
        logits_to_probs(logits, 0.0), torch.tensor(tokens), torch.tensor(parents), torch.tensor([width + 1]), method=method
    )
    assert result.accepted.tolist() == [2]
    assert result.path.tolist() == [[0, 21, 51]]
    assert result.tokens[0].tolist() == [root_best, tokens[-1], int(logits[51].argmax())]


def test_recursive_duplicate_siblings_are_rejected_after_first():
    """Two children with the same token: once the first is rejected, p'(x) = 0 for the second."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3] * 3, [1 / 3] * 3])
    result = verify_tree(
        p,
        torch.tensor([0, 0]),
        torch.tensor([0, 0]),
        torch.tensor([2]),
        method="recursive",
        uniforms=torch.tensor([0.9, 2**-53], dtype=torch.float64),
        noise=torch.ones(1, 2, 3),
    )
    assert result.accepted.tolist() == [0]
    assert result.tokens.tolist() == [[1, -1]]  # the residual keeps only token 1


@pytest.mark.parametrize("method", METHODS)
def test_counter_randomness_is_batch_independent(method):
    sizes = [4, 0, 9, 3]
    probs, tokens, parents, num_nodes = random_trees(sizes, 6, seed=5)
    seeds, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([10, 0, 33, 7])
    full = verify_tree(probs, tokens, parents, num_nodes, method=method, seeds=seeds, offsets=offsets)
    # request 2 alone: rows 6..15, nodes 4..12
    alone = verify_tree(
        probs[6:16], tokens[4:13], parents[4:13], num_nodes[2:3], method=method, seeds=seeds[2:3], offsets=offsets[2:3]
    )
    assert as_lists(alone) == as_lists(full)[2:3]


@pytest.mark.parametrize("method", METHODS)
def test_first_token_distribution(method):
    """Quick losslessness sanity check at T > 0 (the chi-square tests live with the harness)."""
    R, V = 30_000, 4
    p_root = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tokens = torch.tensor([3, 0, 1]).repeat(R)  # root children: tokens 3 and 0; node 3 under node 1
    parents = torch.tensor([0, 0, 1]).repeat(R)
    probs = torch.cat([p_root[None], torch.full((3, V), 0.25)]).repeat(R, 1)
    result = verify_tree(
        probs, tokens, parents, torch.full((R,), 3), method=method, generator=torch.Generator().manual_seed(6)
    )
    freq = torch.bincount(result.tokens[:, 0], minlength=V).double() / R
    assert torch.allclose(freq, p_root.double(), atol=0.012)


def test_recursive_uses_the_swappable_acceptance_rule(monkeypatch):
    probs, tokens, parents, num_nodes = random_trees([5, 5], 3, seed=7)
    monkeypatch.setattr(reference, "acceptance_prob", lambda p, q: torch.zeros_like(p, dtype=torch.float64))
    result = verify_tree(probs, tokens, parents, num_nodes, method="recursive", generator=torch.Generator())
    assert result.accepted.tolist() == [0, 0]


def _tree_case():
    return random_trees([3, 2], 5, seed=8)


def _bad_tree(**changes):
    probs, tokens, parents, num_nodes = _tree_case()
    args = dict(target_probs=probs, tree_tokens=tokens, tree_parents=parents, num_nodes=num_nodes)
    args.update(changes)
    return args


BAD_TREE = [
    ("method", dict(method="beam")),
    ("tree_parents", dict(tree_parents=torch.tensor([0, 1, 3, 0, 1]))),  # node 3 names itself
    ("tree_parents", dict(tree_parents=torch.tensor([0, 1, 1, 0, 2]))),  # node 2 of request 1 names itself
    ("tree_parents", dict(tree_parents=torch.tensor([0, -1, 1, 0, 1]))),
    ("tree_parents", dict(tree_parents=torch.tensor([0, 1, 1, 0]))),  # length
    ("tree_tokens", dict(tree_tokens=torch.tensor([0, 1, 5, 0, 1]))),  # out of range
    ("tree_tokens", dict(tree_tokens=torch.tensor([0, 1, 2, 3]), tree_parents=torch.tensor([0, 1, 1, 0]))),  # ΣN
    ("tree_tokens", dict(tree_tokens=torch.zeros(5))),  # dtype
    ("num_nodes", dict(num_nodes=torch.tensor([6, -1]))),
    ("target_probs", dict(target_probs=torch.full((6, 5), 0.2))),  # rows
    ("target_probs", dict(target_probs=torch.full((7, 5), float("nan")))),
    ("target_probs", dict(target_probs=torch.full((7, 5), 0.3))),
    ("noise", dict(noise=torch.ones(2, 5))),  # [R, D+1, V]
    ("noise", dict(noise=torch.ones(2, 5), method="recursive")),
    ("noise", dict(noise=torch.ones(2, 2, 5), method="recursive")),  # D + 1 = 3
    ("noise", dict(noise=torch.zeros(2, 3, 5))),
    ("uniforms", dict(uniforms=torch.full((5,), 0.5, dtype=torch.float64))),  # match takes none
    ("uniforms", dict(uniforms=torch.zeros(5, dtype=torch.float64), method="recursive")),
    ("seeds", dict(seeds=torch.tensor([1, 2]))),
]


@pytest.mark.parametrize("name,changes", BAD_TREE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_TREE)])
def test_bad_input_names_argument(name, changes):
    with pytest.raises(ValueError, match=f"^{name}"):
        verify_tree(**_bad_tree(**changes))


# -- "sampled": recursive rejection sampling over siblings drawn without replacement ------------


def sampled_oracle(target_probs, draft_probs, tokens, parents, num_nodes, coins, noise):
    """Per-request python walk of method "sampled" (float64); returns (tokens, path) lists."""
    out, row, start = [], 0, 0
    for r, n in enumerate(num_nodes.tolist()):
        par = [None] + parents[start : start + n].tolist()
        tok = [None] + tokens[start : start + n].tolist()
        cur, toks, path, depth = 0, [], [0], 0
        while True:
            p = target_probs[row + cur].double()
            res_p, res_q, nxt = p.clone(), draft_probs[row + cur].double().clone(), None
            for i in (i for i in range(1, n + 1) if par[i] == cur):
                p_hat = res_p / res_p.sum() if res_p.sum() > 0 else res_p * 0
                q_hat = res_q / res_q.sum() if res_q.sum() > 0 else res_q * 0
                x = tok[i]
                if q_hat[x] > 0:
                    prob, q_eff = min(1.0, float(p_hat[x] / q_hat[x])), q_hat
                else:  # outside q's remaining support: a one-hot draft
                    prob, q_eff = float(p_hat[x]), torch.zeros_like(q_hat).index_fill(0, torch.tensor([x]), 1.0)
                if float(coins[start + i - 1]) < prob:
                    nxt = i
                    break
                res_p, res_q = (p_hat - q_eff).clamp(min=0), q_hat.index_fill(0, torch.tensor([x]), 0.0)
            if nxt is None:
                toks.append(int(((res_p if (res_p > 0).any() else p).float() / noise[r, depth]).argmax()))
                break
            toks.append(tok[nxt])
            cur, depth = nxt, depth + 1
            path.append(cur)
        out.append((toks, path))
        row, start = row + n + 1, start + n
    return out


def sampled_case(sizes, V, seed):
    """random_trees with siblings made distinct and a draft distribution per row (some rows with
    zeros, so that siblings fall outside q's support)."""
    probs, tokens, parents, num_nodes = random_trees(sizes, V, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.softmax(torch.randn(probs.shape, generator=g) * 2, -1)
    q = q * (torch.rand(probs.shape, generator=g) > 0.3)
    q[q.sum(-1) == 0, 0] = 1.0
    start = 0
    for n in sizes:  # distinct siblings: node i's token is a fresh one among its parent's children
        seen = {}
        for i in range(start, start + n):
            used = seen.setdefault(int(parents[i]), set())
            free = [t for t in range(V) if t not in used]
            tokens[i] = free[int(torch.randint(len(free), (), generator=g))] if free else tokens[i]
            used.add(int(tokens[i]))
        start += n
    return probs, q, tokens, parents, num_nodes


@pytest.mark.parametrize("sizes,V", [([0], 5), ([6, 0, 12, 1], 7), ([30], 4), ([8] * 20, 3), ([40, 25], 11)])
def test_sampled_matches_oracle(sizes, V):
    probs, q, tokens, parents, num_nodes = sampled_case(sizes, V, seed=sum(sizes) + V)
    g = torch.Generator().manual_seed(V)
    D = tree_depth(parents, sizes)
    coins, noise = torch_uniform((sum(sizes),), generator=g), torch_exponential((len(sizes), D + 1, V), generator=g)
    result = verify_tree(probs, tokens, parents, num_nodes, method="sampled", draft_probs=q, uniforms=coins, noise=noise)
    assert result.tokens.shape == result.path.shape == (len(sizes), D + 1)
    assert torch.equal(result.num_tokens, result.accepted + 1)
    assert as_lists(result) == sampled_oracle(probs, q, tokens, parents, num_nodes, coins, noise)
    if sum(sizes) > 20:
        assert 0 < int(result.accepted.sum()) < sum(sizes)


def _sampled(probs, q, tokens, parents, coins, noise):
    tokens, parents = torch.tensor(tokens), torch.tensor(parents)
    return verify_tree(
        torch.tensor(probs), tokens, parents, torch.tensor([len(tokens)]), method="sampled",
        draft_probs=torch.tensor(q), uniforms=torch.tensor(coins, dtype=torch.float64), noise=noise,
    )  # fmt: skip


def test_sampled_root_without_children_samples_root():
    probs, _, _, _, num_nodes = sampled_case([0, 0], 13, seed=1)
    noise = torch_exponential((2, 1, 13), generator=torch.Generator().manual_seed(2))
    result = verify_tree(probs, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), num_nodes,
                         method="sampled", draft_probs=torch.zeros_like(probs), noise=noise)
    assert result.accepted.tolist() == [0, 0] and result.path.tolist() == [[0], [0]]
    assert torch.equal(result.tokens[:, 0], (probs / noise[:, 0]).argmax(-1))


def test_sampled_p_equal_q_accepts_the_first_child_then_takes_the_leaf_bonus():
    """p == q: min(1, p/q) = 1, accepted even by the largest coin; the leaf's bonus is drawn from
    its own target row with the depth-1 noise (its draft row is ignored)."""
    pq = [0.1, 0.6, 0.3]
    noise = torch.tensor([[[1.0, 1.0, 1.0], [5.0, 1.0, 0.1]]])  # depth 1: argmax(p_leaf / noise) = 2
    leaf = [0.4, 0.4, 0.2]
    result = _sampled([pq, leaf], [pq, [0.0, 0.0, 0.0]], [2], [0], [1 - 2**-53], noise)
    assert result.accepted.tolist() == [1] and result.path.tolist() == [[0, 1]]
    assert result.tokens.tolist() == [[2, 2]]


def test_sampled_all_children_rejected_samples_the_residual():
    """p = (.5, .5, 0, 0) and q = (0, 0, .5, .5): both children (tokens 2, 3) have p = 0, so they
    are rejected by any coin; the residual is p itself and the final token is one of 0, 1."""
    p, q, rest = [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.25] * 4
    for seed in range(8):
        noise = torch_exponential((1, 2, 4), generator=torch.Generator().manual_seed(seed))
        result = _sampled([p, rest, rest], [q, rest, rest], [2, 3], [0, 0], [2**-53, 2**-53], noise)
        assert result.accepted.tolist() == [0]
        assert result.tokens[0, 0] == (torch.tensor(p) / noise[0, 0]).argmax() and result.tokens[0, 1] == -1


def test_sampled_second_sibling_sees_the_normalised_residuals():
    """p = (.5, .5, 0), q = (.8, .2, 0), children 0 then 1: child 0 is accepted with p/q = 5/8;
    after its rejection p' ∝ max(p − q, 0) = (0, .3, 0) and q' ∝ (0, .2, 0), so child 1 is accepted
    with min(1, 1/1) = 1."""
    p, q, flat = [0.5, 0.5, 0.0], [0.8, 0.2, 0.0], [1 / 3] * 3
    noise = torch.ones(1, 2, 3)
    for coin, node in [(0.62, 1), (0.63, 2)]:
        result = _sampled([p, flat, flat], [q, flat, flat], [0, 1], [0, 0], [coin, 1 - 2**-53], noise)
        assert result.accepted.tolist() == [1] and result.path[0, 1] == node


def test_sampled_counter_randomness_is_batch_independent():
    sizes = [4, 0, 9, 3]
    probs, q, tokens, parents, num_nodes = sampled_case(sizes, 6, seed=5)
    seeds, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([10, 0, 33, 7])
    kw = dict(method="sampled", seeds=seeds, offsets=offsets)
    full = verify_tree(probs, tokens, parents, num_nodes, draft_probs=q, **kw)
    alone = verify_tree(probs[6:16], tokens[4:13], parents[4:13], num_nodes[2:3], draft_probs=q[6:16],
                        method="sampled", seeds=seeds[2:3], offsets=offsets[2:3])
    assert as_lists(alone) == as_lists(full)[2:3]


def test_sampled_first_token_distribution():
    """Quick sanity check (the chi-square tests live with the harness): root children drawn
    without replacement from q, first committed token ~ p."""
    R, V = 30_000, 4
    g = torch.Generator().manual_seed(6)
    p_root, q_root = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.3, 0.15, 0.05])
    kids = (q_root / torch_exponential((R, V), generator=g)).topk(2, -1).indices  # [R, 2]
    probs = torch.cat([p_root[None, None].expand(R, 1, V), torch.full((R, 2, V), 0.25)], 1).reshape(-1, V)
    q = torch.cat([q_root[None, None].expand(R, 1, V), torch.zeros(R, 2, V)], 1).reshape(-1, V)
    result = verify_tree(probs, kids.flatten(), torch.zeros(2 * R, dtype=torch.long), torch.full((R,), 2),
                         method="sampled", draft_probs=q, generator=g)
    freq = torch.bincount(result.tokens[:, 0], minlength=V).double() / R
    assert torch.allclose(freq, p_root.double(), atol=0.012)
    assert 0.5 < result.accepted.double().mean() < 0.9


BAD_SAMPLED = [
    ("draft_probs", dict(method="sampled")),  # required
    ("draft_probs", dict(draft_probs=torch.full((7, 5), 0.2))),  # match takes none
    ("draft_probs", dict(method="sampled", draft_probs=torch.full((6, 5), 0.2))),  # rows
    ("draft_probs", dict(method="sampled", draft_probs=torch.full((7, 5), -0.2))),
    ("draft_probs", dict(method="sampled", draft_probs=torch.full((7, 5), 1, dtype=torch.long))),
    ("noise", dict(method="sampled", draft_probs=torch.full((7, 5), 0.2), noise=torch.ones(2, 5))),
]


@pytest.mark.parametrize("name,changes", BAD_SAMPLED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_SAMPLED)])
def test_sampled_bad_input_names_argument(name, changes):
    with pytest.raises(ValueError, match=f"^{name}"):
        verify_tree(**_bad_tree(**changes))
