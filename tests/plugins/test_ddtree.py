"""``ddtree``: the best-first tree (a hand-made example and a heap oracle), its ancestor mask and
positions, Markov/RNN-corrected children, greedy identity, end-to-end losslessness over dflash
and dspark (and a biased variant that must fail it), checkpoints, the CLI spec and bad input."""

from __future__ import annotations

import heapq
import json
import math

import pytest
import torch
from dspec_ddtree import (
    DDTreeConfig,
    DDTreeDrafter,
    grow_sampled_tree,
    grow_tree,
    sampled_shape,
)
from dspec_ddtree.tree import node_depths, node_survival, prune_tree
from test_dflash import PROMPTS, SAMPLINGS, build, plain_greedy
from test_dspark import ForcedSampler, _state_after_prompt, strong
from tiny_models import (
    GreedySampler,
    assert_cli_error,
    full_forward,
    run_cli,
    tiny_target,
)

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.sampling import logits_to_probs, torch_exponential
from dspec_cli.core.types import DraftTree
from dspec_cli.runtime import engine as engine_module
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.kv_cache import ancestor_visibility
from dspec_cli.runtime.schedule import (
    admit_candidates,
    early_stop_count,
    sorted_candidates,
)
from dspec_cli.testing import (
    ToyDrafter,
    ToyLM,
    assert_same_distribution,
    check_engine_lossless,
    exact_target_joint,
    gof_test,
    results_by_concurrency,
    simulate_tree_speculative,
)

BASES = ["dflash", "dspark-markov"]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=0)


def ddtree(target, base: str = "dflash", **options) -> DDTreeDrafter:
    """ddtree over a random base drafter of γ = 4 (``test_dflash.build``)."""
    return DDTreeDrafter(DDTreeConfig(**options), target, build(base, target))


# -- the tree ----------------------------------------------------------------------------------


def table_expand(logp: torch.Tensor, path_sum: bool = False):
    """grow_tree's ``expand`` from a table of child log-probs [D, V, V] indexed by (slot, key):
    key = the node's token, or (``path_sum``) the sum of its path's tokens mod V, carried as
    the per-node state like an RNN head's."""
    V = logp.shape[1]

    def expand(slot, tokens, state):  # tokens [R, W]
        if not path_sum:
            return logp[slot][tokens], None
        total = tokens if state is None else state + tokens  # [R, W]
        return logp[slot][total % V], total

    return expand


def heap_oracle(child_logp, anchor: int, depth: int, budget: int, topk: int) -> dict:
    """The DDTree reference, one heap pop per node: {path (anchor first): score}, in pop order.
    child_logp(path) -> log-probs [V] of the children of the node spelled by ``path``."""

    def top(path):
        lp, tok = child_logp(path).topk(topk)
        return lp.tolist(), tok.tolist()

    kids = {(anchor,): top((anchor,))}
    heap = [(-kids[(anchor,)][0][0], 0, (anchor,), 0.0)]
    popped = {}
    while heap and len(popped) < budget:
        neg, rank, parent, parent_score = heapq.heappop(heap)
        lp, tok = kids[parent]
        path = parent + (tok[rank],)
        popped[path] = -neg
        if rank + 1 < topk:
            heapq.heappush(heap, (-(parent_score + lp[rank + 1]), rank + 1, parent, parent_score))
        if len(path) - 1 < depth:
            kids[path] = top(path)
            heapq.heappush(heap, (neg - kids[path][0][0], 0, path, -neg))
    return popped


def spine_oracle(child_logp, anchor: int, depth: int, budget: int, topk: int) -> dict:
    """grow_tree's set: the spine (best child of best child ..., cut to the budget) and the
    heap's best other prefixes for the rest of the budget (all within its first ``budget`` pops)."""
    spine, path, score = {}, (anchor,), 0.0
    for _ in range(min(depth, budget)):
        lp, tok = child_logp(path).topk(1)
        path, score = path + (int(tok[0]),), score + float(lp[0])
        spine[path] = score
    rest = [(p, s) for p, s in heap_oracle(child_logp, anchor, depth, budget, topk).items() if p not in spine]
    return {**spine, **dict(rest[: budget - len(spine)])}


def tree_paths(anchor: int, tokens, parents, scores) -> dict:
    """{path (anchor first): score} of one row of a tree."""
    paths, out = {0: (anchor,)}, {}
    for i, (t, p, s) in enumerate(zip(tokens.tolist(), parents.tolist(), scores.tolist(), strict=True)):
        paths[i + 1] = paths[p] + (t,)
        out[paths[i + 1]] = s
    return out


def max_depth(parents: torch.Tensor) -> int:
    depth = [0]
    for p in parents.tolist():
        depth.append(depth[p] + 1)
    return max(depth)


HAND = torch.tensor([[0.3, 0.05, 0.5, 0.15], [0.1, 0.04, 0.06, 0.8], [0.2, 0.4, 0.05, 0.35]])  # p_slot(token)


def test_hand_made_tree_follows_the_heap():
    """Independent per-slot marginals (DFlash), K = 2, budget 5: the heap pops (2) .5, (2,3) .4,
    (0) .3, (0,3) .24, (2,3,1) .16; the tree holds exactly those, depth-major, parents first."""
    logp = HAND.log()[:, None, :].expand(3, 4, 4)
    anchor = torch.tensor([1])
    tokens, parents, scores = grow_tree(table_expand(logp), anchor, 3, 5, 2)
    assert tokens.tolist() == [[2, 0, 3, 3, 1]] and parents.tolist() == [[0, 0, 1, 2, 3]]
    torch.testing.assert_close(scores.exp(), torch.tensor([[0.5, 0.3, 0.4, 0.24, 0.16]]))
    popped = heap_oracle(lambda path: logp[len(path) - 1, 0], 1, 3, 5, 2)
    assert list(popped) == [(1, 2), (1, 2, 3), (1, 0), (1, 0, 3), (1, 2, 3, 1)]
    assert popped.keys() == tree_paths(1, tokens[0], parents[0], scores[0]).keys()
    full, _, _ = grow_tree(table_expand(logp), anchor, 3, 100, 2)  # budget above the K-ary tree
    assert full.shape == (1, 2 + 4 + 8)
    with pytest.raises(ValueError, match="budget"):
        grow_tree(table_expand(logp), anchor, 3, 0, 2)


@pytest.mark.parametrize("path_sum", [False, True], ids=["markov", "path-state"])
@pytest.mark.parametrize("budget, topk", [(1, 3), (7, 3), (20, 4), (40, 12)])
def test_tree_equals_heap_oracle(path_sum, budget, topk):
    """Children that depend on the parent's token (Markov) or on the whole path (a state, like the
    RNN head): the depth-batched tree is the spine plus the heap's best other prefixes, with the
    same scores."""
    D, V = 4, 12
    logp = torch.log_softmax(2 * torch.randn(D, V, V, generator=torch.Generator().manual_seed(budget)), -1)
    anchors = torch.tensor([0, 5, 11])
    tokens, parents, scores = grow_tree(table_expand(logp, path_sum), anchors, D, budget, topk)
    assert tokens.shape == (3, budget)
    assert ((parents >= 0) & (parents <= torch.arange(budget))).all()  # node i+1's parent precedes it
    key = (lambda path: sum(path) % V) if path_sum else (lambda path: path[-1])
    for r, a in enumerate(anchors.tolist()):
        want = spine_oracle(lambda path: logp[len(path) - 1, key(path)], a, D, budget, topk)
        got = tree_paths(a, tokens[r], parents[r], scores[r])
        assert got.keys() == want.keys()
        assert all(math.isclose(got[p], want[p], abs_tol=1e-4) for p in want)


def _sampled_tree(logp, anchors, depth, budget, topk, seed, top_k=0, redraw_last=False):
    """grow_sampled_tree over a Markov table; the draws of the last level are redrawn with
    another seed when ``redraw_last``."""
    V = logp.shape[1]

    def probs(logits):
        return logits_to_probs(logits, 1.0, top_k)

    def draw(slot, q, n):  # the exponential race: the n largest q / E, in order
        g = torch.Generator().manual_seed(1000 * seed + slot + (500 if redraw_last and slot == depth - 1 else 0))
        return (q / torch_exponential(q.shape, generator=g)).topk(n, dim=-1).indices

    assert V == logp.shape[2]
    return grow_sampled_tree(table_expand(logp), probs, draw, anchors, depth, sampled_shape(budget, depth, topk, 0.7, 0.3))


def _shape_paths(children: torch.Tensor) -> list[tuple[int, ...]]:
    """The rank paths (1-based) of a sampled_shape's nodes, in id order; checks the numbering."""
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for v in range(children.shape[0]):
        kids = [k for k in children[v].tolist() if k >= 0]
        assert children[v, len(kids):].eq(-1).all()  # padding only after the children
        for j, k in enumerate(kids):
            assert k > v and k not in paths  # parents first, every node once
            paths[k] = paths[v] + (j + 1,)
    assert sorted(paths) == list(range(children.shape[0]))
    order = [paths[i] for i in range(children.shape[0])]
    assert [len(p) for p in order] == sorted(len(p) for p in order)  # depth-major
    return order[1:]


def _rates(topk: int, accept: float, rescue: float) -> list[float]:
    return [accept] + [(1 - accept) * (1 - rescue) ** (j - 2) * rescue for j in range(2, topk + 1)]


def _best_worth(n: int, depth: int, topk: int, rate: list[float]) -> float:
    """Brute force: the largest total worth (product of per-rank rates along each path) of a
    tree of n nodes holding the spine, siblings in draw order."""
    worth = lambda path: math.prod(rate[r - 1] for r in path)  # noqa: E731
    best, seen = 0.0, set()

    def grow(tree: frozenset) -> None:
        nonlocal best
        if tree in seen:
            return
        seen.add(tree)
        if len(tree) == n:
            best = max(best, sum(map(worth, tree)))
            return
        for v in [(), *tree]:
            k = 1 + max((p[-1] for p in tree if len(p) == len(v) + 1 and p[:-1] == v), default=0)
            if len(v) < depth and k <= topk:
                grow(tree | {v + (k,)})

    grow(frozenset((1,) * d for d in range(1, min(depth, n) + 1)))
    return best


@pytest.mark.parametrize("budget, depth, topk, accept, rescue", [
    (1, 3, 3, 0.7, 0.3), (5, 3, 3, 0.7, 0.3), (8, 3, 4, 0.5, 0.5), (8, 4, 3, 0.85, 0.1), (9, 3, 3, 0.6, 0.4)])
def test_sampled_shape_is_the_most_valuable_tree_holding_the_spine(budget, depth, topk, accept, rescue):
    """sampled_shape keeps the spine and, among trees with it whose siblings come in draw order,
    reaches the largest total worth: brute force; a shape built for other rates falls short."""
    rate = _rates(topk, accept, rescue)
    worth = lambda paths: sum(math.prod(rate[r - 1] for r in p) for p in paths)  # noqa: E731
    paths = _shape_paths(sampled_shape(budget, depth, topk, accept, rescue))
    assert len(paths) == min(budget, sum(topk ** d for d in range(1, depth + 1)))
    assert {(1,) * d for d in range(1, min(depth, budget) + 1)} <= set(paths)
    assert max(map(len, paths)) <= depth and max(max(p) for p in paths) <= topk
    best = _best_worth(len(paths), depth, topk, rate)
    assert math.isclose(worth(paths), best, rel_tol=1e-9)
    if budget > 5:  # control: the check tells a shape built for a much higher rescue rate apart
        assert worth(_shape_paths(sampled_shape(budget, depth, topk, accept, 0.9))) < best - 1e-9


@pytest.mark.parametrize("budget, topk, top_k", [(1, 1, 0), (6, 6, 0), (20, 4, 0), (30, 30, 3)])
def test_sampled_tree_structure(budget, topk, top_k):
    """Distinct siblings inside q's support, parents first, at most ``budget`` nodes, q rows of
    the nodes' own distributions, a spine of first children as deep as the budget allows; and the shape of a level does not depend on the level's
    samples: redrawing the last level's noise keeps every node's number of children."""
    D, V = 4, 12
    logp = torch.log_softmax(2 * torch.randn(D, V, V, generator=torch.Generator().manual_seed(budget)), -1)
    anchors = torch.tensor([0, 5, 11])
    tokens, parents, scores, num_nodes, q = _sampled_tree(logp, anchors, D, budget, topk, seed=budget, top_k=top_k)
    assert tokens.shape == parents.shape == (3, budget) and q.shape == (3, budget + 1, V)
    assert (num_nodes <= budget).all() and (num_nodes > 0).all()
    for r in range(3):
        n = int(num_nodes[r])
        par, tok = [0] + parents[r, :n].tolist(), [int(anchors[r])] + tokens[r, :n].tolist()
        assert (tokens[r, n:] == -1).all() and (parents[r, n:] == -1).all()
        depth = [0]
        for i in range(1, n + 1):
            assert 0 <= par[i] < i
            depth.append(depth[par[i]] + 1)
        assert max(depth) <= D
        for v in range(n + 1):
            kids = [tok[i] for i in range(1, n + 1) if par[i] == v]
            assert len(kids) == len(set(kids)) <= topk
            if kids:  # node v's row is the distribution its children were drawn from
                want = logits_to_probs(logp[depth[v]][tok[v]][None], 1.0, top_k)[0]
                torch.testing.assert_close(q[r, v], want)
                assert all(want[k] > 0 for k in kids)
        spine, v = 0, 0  # first child of first child ...: a chain's drafts, as deep as the budget allows
        while kid := [i for i in range(1, n + 1) if par[i] == v][:1]:
            spine, v = spine + 1, kid[0]
        assert spine == min(D, budget)
    redrawn = _sampled_tree(logp, anchors, D, budget, topk, seed=budget, top_k=top_k, redraw_last=True)
    for r in range(3):
        counts = [torch.bincount(t[3][r].new_tensor(t[1][r, : int(t[3][r])].tolist()), minlength=budget + 1)
                  for t in ((tokens, parents, scores, num_nodes), redrawn)]
        assert torch.equal(counts[0], counts[1])


def test_tree_compiles_to_ancestor_mask_and_positions(target):
    """The target verifies the tree with visibility = ancestors and self, position = committed
    length + depth: every node's logits equal a plain forward of the prompt and the node's path."""
    vis = ancestor_visibility(torch.tensor([[-1, 0, 0, 1, 2, 3]]))[0]  # root + the hand-made tree
    want = torch.zeros(6, 6, dtype=torch.bool)
    for node, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]]):
        want[node, ancestors] = True
    assert torch.equal(vis, want) and (vis.sum(-1) - 1).tolist() == [0, 1, 1, 2, 2, 3]

    drafter = ddtree(target, "dspark-markov", tree_budget=12, tree_topk=3)
    prompt = target.render_prompt(PROMPTS[0])
    batch = target.new_batch(drafter.target_layer_ids)
    out = target.prefill(batch, [prompt])
    state = drafter.init_state()
    drafter.add_requests(state, [torch.tensor(prompt)], out.hidden)
    anchor = out.logits.argmax(-1)
    tree = drafter.propose(state, anchor, 4, None).tree
    assert tree.num_nodes.tolist() == [12] and max_depth(tree.parents[0]) >= 2
    tokens = torch.cat([anchor, tree.tokens[0]])
    parents = torch.cat([torch.tensor([-1]), tree.parents[0]])
    with torch.no_grad():
        logits = target.score(batch, tokens[None], parents[None], batch.window(13))[0][0]
    paths = {0: [int(anchor)]}
    for i in range(1, 13):
        paths[i] = paths[int(parents[i])] + [int(tokens[i])]
    for i in range(13):
        full, _ = full_forward(target, torch.tensor([prompt + paths[i]]))
        torch.testing.assert_close(logits[i], full[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["dspark-markov", "dspark-rnn"])
def test_children_are_the_sequential_heads_conditionals(target, name):
    """Over DSpark, a node's children are the top tokens of the head-corrected distribution given
    the node's token (RNN: its path), and each child's score adds log q(child): q as sampled by
    the base drafter's own sequential propose with that prefix forced."""
    base = strong(build(name, target))
    drafter = DDTreeDrafter(DDTreeConfig(tree_budget=24, tree_topk=4), target, base)
    state = _state_after_prompt(target, base, "The quick brown fox")
    anchors = torch.tensor([17])
    tree, scores = drafter.draft_tree(state, anchors, 4)
    uncorrected = base.block_logits(state, anchors)[0].log_softmax(-1)  # [γ, V] backbone only
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    paths, score = {0: []}, {0: 0.0}
    head_matters = False
    for i, (x, p) in enumerate(zip(tokens, parents, strict=True)):
        k = len(paths[p])
        forced = torch.tensor([paths[p] + [0] * (4 - k)])
        q = base.propose(state, anchors, k + 1, ForcedSampler(forced)).draft_probs[0, k]  # [V]
        assert math.isclose(float(scores[0, i]) - score[p], float(q[x].log()), abs_tol=1e-4)
        siblings = {t for t, pp in zip(tokens, parents, strict=True) if pp == p}
        assert siblings == set(q.topk(len(siblings)).indices.tolist())
        head_matters |= not math.isclose(float(q[x].log()), float(uncorrected[k, x]), abs_tol=1e-2)
        paths[i + 1], score[i + 1] = paths[p] + [x], float(scores[0, i])
    assert head_matters and max(map(len, paths.values())) >= 2


@pytest.mark.parametrize("name", ["dflash", "dspark-markov", "dspark-rnn"])
def test_best_tree_holds_the_greedy_chain(target, name):
    """A small budget keeps the base drafter's greedy chain as a path from the root (the spine),
    so at T = 0 the tree accepts at least what the chain does; the remaining nodes are the best
    other prefixes."""
    base = strong(build(name, target)) if name != "dflash" else build(name, target)
    state = _state_after_prompt(target, base, "The quick brown fox")
    anchors = torch.tensor([17])
    chain = base.propose(state, anchors, 4, GreedySampler()).tokens[0].tolist()
    for budget in (2, 4, 6):
        drafter = DDTreeDrafter(DDTreeConfig(tree_budget=budget, tree_topk=4), target, base)
        tree, _ = drafter.draft_tree(state, anchors, 4)
        paths = set(tree_paths(17, tree.tokens[0], tree.parents[0], tree.parents[0].float()))
        assert tuple([17] + chain[: min(budget, 4)]) in paths


# -- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("R", [1, 8])
def test_greedy_equals_plain_greedy(target, base, R):
    prompts = [target.render_prompt(p) for p in PROMPTS] * 3
    greedy = {tuple(p): plain_greedy(target, p, 16) for p in prompts}
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, block_size=4, max_batch=R)
    results = SpeculativeEngine(target, ddtree(target, base, tree_budget=32), cfg, stop_ids=[]).generate(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == greedy[tuple(prompt)]
    assert {v for r in results for v in r.verified} == {0, 32}  # the budget (0: the last token)
    assert sum(a for r in results for a in r.accepted) > 0


@pytest.mark.parametrize("base", BASES)
def test_batch_invariant(target, base):
    """Seeded outputs are the same at R = 1, 8 and 24 (so one chi-square covers every R). The
    batched backbone's GEMMs round differently at different R (q differs by ~1e-7), which can
    move an inverse-CDF draw across a token boundary about once in 10^7 draws: one of the 48
    requests may differ (a batch-dependent bug changes many)."""
    prompts = [target.render_prompt(p) for p in PROMPTS] * 8
    drafter = ddtree(target, base)
    runs = results_by_concurrency(target, drafter, prompts, (1, 8, 24), max_new_tokens=8, temperature=1.0,
                                  block_size=4, seed=5)
    outs = [[r.output_ids for r in results] for results in runs]
    for other in outs[1:]:
        assert sum(a != b for a, b in zip(outs[0], other, strict=True)) <= 1
    assert sum(a for r in runs[-1] for a in r.accepted) > 0


def check_lossless(target, base: str, sampling: dict, R: int | None, per_prompt: int, verify: dict | None = None,
                   **options) -> None:
    prompts = [target.render_prompt(PROMPTS[0])]
    results = check_engine_lossless(target, ddtree(target, base, **options), prompts, per_prompt=per_prompt,
                                    max_batch=R, sampling=sampling, name=f"ddtree:{base} R={R}", verify=verify)
    assert sum(sum(r.accepted) for r in results) > 0  # tree nodes were really accepted


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lossless_quick(target, base, sampling):
    check_lossless(target, base, sampling, None, 4000, tree_budget=8, tree_mode="best")


@pytest.mark.parametrize("rule", ["sampled", "traversal"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_sampled_tree_lossless(target, sampling, rule, monkeypatch):
    """The sampled tree over DSpark-Markov, verified with its q by recursive rejection sampling
    ("sampled") or traversal verification."""
    methods = []
    verify = engine_module.verify_tree_grid
    monkeypatch.setattr(engine_module, "verify_tree_grid",
                        lambda *a, **kw: methods.append(kw["method"]) or verify(*a, **kw))
    check_lossless(target, "dspark-markov", sampling, None, 4000, verify=dict(tree_verify=rule), tree_budget=8,
                   tree_mode="sampled")
    assert set(methods) == {rule}


def test_lossless_check_catches_sampled_siblings_chosen_by_value(target, monkeypatch):
    """The same check fails when the siblings are the top-m of q but are verified as a sample
    without replacement from q."""
    monkeypatch.setattr(engine_module.RoundSampler, "sample_distinct", lambda self, q, n, step: q.topk(n, dim=-1).indices)
    with pytest.raises(AssertionError, match="distribution mismatch"):
        check_lossless(target, "dspark-markov", dict(temperature=1.0), None, 4000, tree_budget=8, tree_mode="sampled")


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("R", [1, 8])
def test_lossless_end_to_end(target, base, sampling, R):
    check_lossless(target, base, sampling, R, 3000)


def test_lossless_check_catches_a_tree_verified_without_its_mask(target, monkeypatch):
    """The same check fails when every tree node sees the whole tree (no ancestor mask)."""
    monkeypatch.setattr(
        "dspec_cli.runtime.target.ancestor_visibility",
        lambda parents: torch.ones(*parents.shape, parents.shape[1], dtype=torch.bool, device=parents.device),
    )
    with pytest.raises(AssertionError, match="distribution mismatch"):
        check_lossless(target, "dflash", dict(temperature=1.0), None, 4000, tree_budget=8)


# -- configuration, checkpoints, CLI -----------------------------------------------------------


def test_registered_and_checkpoints(target, tmp_path, monkeypatch):
    assert get_drafter_class("ddtree") is DDTreeDrafter and "tree" in DDTreeDrafter.capabilities
    assert {"marginals"} <= get_drafter_class("dspark").capabilities & get_drafter_class("dspark-rnn").capabilities
    drafter = ddtree(target, "dspark-markov", tree_budget=8)
    drafter.save_pretrained(tmp_path / "ckpt")  # a ddtree checkpoint is its base's
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["drafter"] == "dspark-markov"
    loaded = DDTreeDrafter.from_pretrained(tmp_path / "ckpt", target, tree_budget=8)  # base from the checkpoint
    assert (loaded.config.base, loaded.config.block_size, loaded.config.tree_budget) == ("dspark-markov", 4, 8)
    state = _state_after_prompt(target, drafter, "Numbers like 0 1 2")
    trees = [d.draft_tree(state, torch.tensor([17]), 4)[0] for d in (drafter, loaded)]
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    with pytest.raises(DspecError, match="holds a 'dspark-markov' drafter, not 'dflash'"):
        DDTreeDrafter.from_pretrained(tmp_path / "ckpt", target, base="dflash")
    monkeypatch.setattr("dspec_cli.checkpoints.persist.embedded_path", lambda name: tmp_path / name)
    with pytest.raises(DspecError, match="no trained dspark-markov drafter is embedded"):
        DDTreeDrafter.load_default(target)  # the default base
    drafter.save_pretrained(tmp_path / "drafters" / "dspark-markov")
    assert DDTreeDrafter.load_default(target, block_size=3).base.config.block_size == 3
    assert DDTreeDrafter.load_default(target, base="dspark", block_size=3).base.name == "dspark-markov"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tree_budget=0), "tree_budget must be an integer >= 1, got 0"),
        (dict(tree_budget=256), "tree_budget 256 does not fit the target's context of 256 tokens"),
        (dict(tree_topk=-1), "tree_topk must be an integer >= 0"),
        (dict(tree_mode="beam"), "tree_mode must be one of best, sampled, got 'beam'"),
        (dict(tree_accept=1.0), "tree_accept must be a number in (0, 1), got 1.0"),
        (dict(tree_rescue=0), "tree_rescue must be a number in (0, 1), got 0"),
        (dict(tree_shape="auto"), "tree_shape must be one of static, confidence, got 'auto'"),
        (dict(tree_shape="confidence"), "tree_shape=confidence needs cost_table=PATH"),
        (dict(cost_table="table.json"), "tree_shape=confidence needs cost_table=PATH"),
        (dict(tree_shape="confidence", cost_table="missing.json"), "cost_table missing.json: file not found"),
        (dict(tree_topk=385), "tree_topk 385 exceeds the vocabulary (384)"),
        (dict(base="eagle3"), "base 'eagle3' has no per-position marginals (capability 'marginals'); ddtree bases: dflash, dspark-markov, dspark-rnn"),
        (dict(base="prompt-lookup"), "base 'prompt-lookup' has no per-position marginals"),
        (dict(base="draft-model"), "base 'draft-model' has no per-position marginals"),
        (dict(base="ddtree"), "base 'ddtree' has no per-position marginals"),
        (dict(base="nope"), "base 'nope' is not an installed drafter; ddtree bases: dflash"),
    ],
)
def test_bad_input(target, options, message):
    with pytest.raises(DspecError) as err:
        DDTreeDrafter.build(DDTreeConfig(**options), target)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_bench(target, model_dir, tmp_path, capsys):
    """`--drafter ddtree` takes the base from the checkpoint; `ddtree:BASE,KEY=VALUE` sets options."""
    build("dspark-markov", target).save_pretrained(tmp_path / "dspark")
    report = tmp_path / "bench.json"
    specs = ["ddtree", "ddtree:dspark,tree_budget=8,tree_topk=2"]
    code, _, err = run_cli(
        ["bench", "--target", str(model_dir), "--drafter", specs[0], "--drafter", specs[1], "--checkpoint",
         str(tmp_path / "dspark"), "--checkpoint", str(tmp_path / "dspark"), "--num-prompts", "2",
         "--max-new-tokens", "8", "--block-size", "4", "--json", str(report)],
        capsys,
    )
    assert code == 0, err
    runs = {r["drafter"]: r for r in json.loads(report.read_text())["runs"]}
    assert set(runs) == set(specs) and all(r["tau"] >= 1 for r in runs.values())
    assert runs[specs[0]]["mean_verified"] > 8 >= runs[specs[1]]["mean_verified"]  # budgets 32 and 8
    for spec, message in [
        ("ddtree:eagle3", "base 'eagle3' has no per-position marginals"),
        ("ddtree,tree_budget=0", "tree_budget must be an integer >= 1, got 0"),
        ("ddtree,budget=8", "unknown option(s) budget; valid: target_layer_ids, base, tree_budget, tree_topk, tree_mode"),
        ("ddtree,tree_budget=lots", "tree_budget expects int, got 'lots'"),
        ("ddtree,block_size=3", "unknown option(s) block_size"),
    ]:
        assert_cli_error(["bench", "--target", str(model_dir), "--drafter", spec], capsys, message)


# -- confidence budgets (tree_shape=confidence) ------------------------------------------------


def steep_cost_table(path, slope: float = 0.05) -> str:
    """A cost table whose steps cost 1 + slope·B: every verified node must earn its price."""
    grid = [*range(1, 512), *range(512, 65537, 512)]
    CostTable(device="cpu", device_name="", dtype="float32", model="", torch="", grid=grid, contexts=[128],
              measured={"128": [1.0 / (1 + slope * b) for b in grid]}).save(path)
    return str(path)


def test_node_survival_by_hand():
    """Root children with c_root = 0.6 and rescue 0.5: 0.6, then min(0.6, 0.4·0.5) = 0.2, then
    0.4·0.5·0.5 = 0.1; node 1's children (c = 0.9): 0.6·0.9 and 0.6·min(0.9, 0.1·0.5)."""
    parents = torch.tensor([[0, 0, 0, 1, 1, -1]])
    conf = torch.tensor([[0.6, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5]])
    a = node_survival(parents, conf, 0.5, depth=2)
    assert torch.allclose(a, torch.tensor([[0.6, 0.2, 0.1, 0.54, 0.03, 0.0]], dtype=torch.float64))
    # a confident node keeps a chain, an unsure one gets siblings worth more than its deep child
    sure, unsure = node_survival(parents, conf.fill_(0.9), 0.5, 2), node_survival(parents, conf.fill_(0.2), 0.5, 2)
    assert sure[0, 3] > sure[0, 1] and unsure[0, 1] > unsure[0, 3]
    assert node_depths(parents, 2).tolist() == [[0, 1, 1, 1, 2, 2, 0]]


def test_admit_candidates_is_algorithm_1():
    """The admitted candidates are the first early_stop_count ones in sorted order."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(6, 9, generator=g, dtype=torch.float64)
    valid = torch.rand(6, 9, generator=g) > 0.2
    sps = 1.0 / (1 + 0.04 * torch.arange(64, dtype=torch.float64).clamp(min=1))
    keep = admit_candidates(a, valid, sps)
    values, rows, num_valid = sorted_candidates(a, valid)
    count = int(early_stop_count(values, num_valid, 6, sps))
    assert int(keep.sum()) == count and 0 < count < int(valid.sum())
    assert (a[keep].min() >= a[valid & ~keep].max()) and not (keep & ~valid).any()


def test_prune_tree_renumbers_the_kept_nodes():
    tokens = torch.tensor([[5, 6, 7, 8, 9], [1, 2, -1, -1, -1]])
    parents = torch.tensor([[0, 0, 1, 2, 3], [0, 1, -1, -1, -1]])
    scores = torch.arange(10.0).view(2, 5)
    q = torch.arange(2 * 6 * 3, dtype=torch.float).view(2, 6, 3)
    keep = torch.tensor([[True, False, True, False, True], [False, False, False, False, False]])
    t, p, sc, n, qq = prune_tree(tokens, parents, scores, q, keep)
    assert t.tolist() == [[5, 7, 9], [-1, -1, -1]] and p.tolist() == [[0, 1, 2], [-1, -1, -1]]
    assert n.tolist() == [3, 0] and sc[0].tolist() == [0.0, 2.0, 4.0]
    assert torch.equal(qq[0], q[0, [0, 1, 3, 5]]) and torch.equal(qq[1, 1:], torch.zeros(3, 3))


def test_confidence_trees_follow_the_cost_table(target, tmp_path):
    """A steeper cost table keeps fewer nodes; the kept trees are valid (prefix-closed, siblings
    in draw order) subtrees of the static ones, whose sizes vary by request."""
    prompts = [target.render_prompt(p) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=16, block_size=4, max_batch=4, seed=2)
    sizes = {}
    for slope in (0.01, 0.1):
        drafter = ddtree(target, "dspark-markov", tree_budget=16, tree_shape="confidence",
                         cost_table=steep_cost_table(tmp_path / f"t{slope}.json", slope))
        trees = []
        draft = drafter.draft_sampled_tree

        def record(*args, draft=draft, trees=trees):
            out = draft(*args)
            trees.append(out[0])
            return out

        drafter.draft_sampled_tree = record
        SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)
        sizes[slope] = torch.cat([t.num_nodes for t in trees]).double()
        for tree in trees:
            real = tree.parents >= 0
            assert ((tree.parents < torch.arange(1, tree.parents.shape[1] + 1)) | ~real).all()
            assert (torch.arange(tree.tokens.shape[1]) < tree.num_nodes[:, None]).eq(real).all()
    assert sizes[0.1].mean() < sizes[0.01].mean() <= 16
    assert sizes[0.01].max() > sizes[0.01].min()


@pytest.mark.parametrize("rule", ["sampled", "traversal"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_confidence_tree_lossless(target, tmp_path, sampling, rule):
    """4000 requests in one batch: a slope of 2e-4 per token keeps the nodes worth more than ~0.4."""
    check_lossless(target, "dspark-markov", sampling, None, 4000, verify=dict(tree_verify=rule), tree_budget=8,
                   tree_shape="confidence", cost_table=steep_cost_table(tmp_path / "table.json", 2e-4))


def _budget_policy(own_value: bool, depth: int = 3, rescue: float = 0.3):
    """testing.simulate_tree_speculative's tree_policy: the confidence budget's pipeline
    (node_survival with c_v = Σq_v², admit_candidates over the batch, prune_tree), or, with
    ``own_value``, every node priced by its own draft probability (an anticipating value)."""

    def cut(tree):
        R, N = tree.tokens.shape
        q = tree.draft_probs  # [R, N+1, V]
        conf = q.pow(2).sum(-1)
        if own_value:
            own = q.gather(1, tree.parents.clamp(min=0)[..., None].expand(-1, -1, q.shape[-1]))
            own = own.gather(2, tree.tokens.clamp(min=0)[..., None]).squeeze(-1)  # q_parent(x_node)
            conf = torch.cat([own, own[:, -1:]], 1)  # node v priced with node v+1's own value
        survival = node_survival(tree.parents, conf, rescue, depth)
        valid = torch.arange(N) < tree.num_nodes[:, None]
        sps = 1.0 / (1 + torch.arange(R * (N + 1) + 1, dtype=torch.float64).clamp(min=1) / R)  # cutoff ~ 0.4
        tokens, parents, _, num_nodes, q = prune_tree(tree.tokens, tree.parents, torch.zeros(R, N), q,
                                                      admit_candidates(survival, valid, sps))
        return DraftTree(tokens=tokens, parents=parents, num_nodes=num_nodes, draft_probs=q)

    return cut


@pytest.mark.parametrize("rule", ["traversal", "sampled"])
def test_budget_cut_is_lossless_and_an_anticipating_cut_is_caught(rule):
    """Toy chains (V = 8, 100k requests): trees cut by confidence budgets verify exactly; the
    same cut with values that look at the nodes' own tokens fails the same chi-square."""
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    target, drafter = ToyLM.random(8, scale=2.0, generator=g(3)), ToyDrafter(ToyLM.random(8, scale=2.0, generator=g(4)))
    joint = exact_target_joint(target, 1, 2)
    kw = dict(num_requests=100_000, depth=3, branching=2, num_tokens=2, x0=1, method=rule)
    tokens = simulate_tree_speculative(target, drafter, generator=g(5), tree_policy=_budget_policy(False), **kw)
    assert_same_distribution(tokens, joint, alpha=1e-5, name=f"budget cut, {rule}")
    biased = simulate_tree_speculative(target, drafter, generator=g(5), tree_policy=_budget_policy(True), **kw)
    assert gof_test(biased, joint).p_value < 1e-12
