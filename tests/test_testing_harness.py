"""Sanity tests of the statistical harness itself (dspec_cli.testing)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dspec_cli import Proposal, VerifyResult, verify_chain
from dspec_cli import testing as T

scipy_stats = pytest.importorskip("scipy.stats")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dof", [1, 2, 3, 7, 10, 63, 255, 1023])
def test_chi2_sf_fallback_matches_scipy(dof):
    for x in np.concatenate([[0.0, 1e-3, 0.5], dof * np.array([0.3, 0.9, 1.0, 1.1, 2.0, 4.0]), [dof + 200.0]]):
        want = scipy_stats.chi2.sf(x, dof)
        got = T.chi2_sf(float(x), dof, method="gamma")
        assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (x, dof)


def test_chi_square_gof_matches_scipy_chisquare():
    probs = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    counts = np.array([95, 210, 290, 160, 245])
    stat, dof, p = T.chi_square_gof(counts, probs)
    want = scipy_stats.chisquare(counts, counts.sum() * probs)
    assert dof == 4
    assert stat == pytest.approx(want.statistic, rel=1e-12)
    assert p == pytest.approx(want.pvalue, rel=1e-9)
    assert T.chi_square_gof(counts, probs, 5)[2] == pytest.approx(T.chi2_sf(stat, 4, method="gamma"), rel=1e-9)


def test_chi_square_gof_pools_low_bins_and_fails_on_impossible_bins():
    probs = np.array([0.49, 0.49, 0.01, 0.005, 0.005, 0.0])
    stat, dof, p = T.chi_square_gof([500, 480, 12, 3, 5, 0], probs, min_expected=20)
    assert dof == 2  # bins {0}, {1}, {2, 3, 4}: the pooled bin expects 10 + 5 + 5 = 20
    assert stat == pytest.approx(10**2 / 490 + 10**2 / 490 + 0)
    stat, dof, p = T.chi_square_gof([49, 49, 1, 1, 0, 0], probs)  # n = 100: the pool takes a big bin too
    assert dof == 1 and stat == pytest.approx(0.0)
    assert T.chi_square_gof([49, 49, 1, 0, 0, 1], probs) == (float("inf"), 4, 0.0)
    assert T.chi_square_gof([3], [1.0]) == (0.0, 0, 1.0)
    with pytest.raises(ValueError, match="expected_probs"):
        T.chi_square_gof([1, 2], [0.5, 0.6])
    with pytest.raises(ValueError, match="observed_counts"):
        T.chi_square_gof([1, -2], [0.5, 0.5])


def _shifted(probs: torch.Tensor, amount: float) -> torch.Tensor:
    out = probs.clone()
    out[0] -= amount
    out[1] += amount
    return out


def test_detects_a_0_05_shift_with_200k_samples():
    probs = torch.full((10,), 0.1, dtype=torch.float64)
    samples = torch.multinomial(_shifted(probs, 0.05), 200_000, replacement=True, generator=_gen(1))
    with pytest.raises(AssertionError) as info:
        T.assert_same_distribution(samples, probs, name="shifted")
    msg = str(info.value)
    assert "shifted: chi-square" in msg and "dof = 9" in msg and "p = 0" in msg
    assert "0: 0.05" in msg  # the worst bin is listed with its observed frequency
    assert T.gof_test(samples, probs).p_value < 1e-100


def test_accepts_exact_samples():
    probs = torch.rand(10, generator=_gen(2), dtype=torch.float64) + 0.01
    probs /= probs.sum()
    pvals = []
    for seed in range(20):
        samples = torch.multinomial(probs, 200_000, replacement=True, generator=_gen(100 + seed))
        pvals.append(T.assert_same_distribution(samples, probs).p_value)
    assert np.mean(pvals) == pytest.approx(0.5, abs=0.2)  # p-values of a true null are uniform


def test_joint_samples_and_labels():
    V = 4
    probs = torch.rand(V, V, generator=_gen(3), dtype=torch.float64)
    probs /= probs.sum()
    flat = torch.multinomial(probs.reshape(-1), 100_000, replacement=True, generator=_gen(4))
    pairs = torch.stack([flat // V, flat % V], 1)
    assert torch.equal(T.joint_index(pairs, V), flat)
    assert T.assert_same_distribution(pairs, probs).dof == V * V - 1
    bad = pairs.clone()
    bad[:, 1] = bad[:, 0]  # second token copies the first
    with pytest.raises(AssertionError, match=r"\(\d, \d\): "):
        T.assert_same_distribution(bad, probs, name="pairs")
    padded = pairs.clone()
    padded[0, 1] = -1
    assert T.gof_test(padded, probs).p_value == 0.0


def test_harness_imports_and_works_without_scipy():
    code = (
        "import sys; sys.modules['scipy'] = None; sys.modules['scipy.stats'] = None\n"
        "from dspec_cli import testing as T\n"
        "s, d, p = T.chi_square_gof([40, 60], [0.5, 0.5])\n"
        "assert d == 1 and abs(p - 0.04550026389635842) < 1e-12, p\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_exact_joint_matches_plain_sampling():
    target = T.ToyLM.random(6, generator=_gen(5), temperature=0.8, top_k=4)
    samples = T.sample_target(target, num_requests=100_000, num_tokens=3, x0=1, generator=_gen(6))
    joint = T.exact_target_joint(target, 1, 3)
    assert joint.shape == (6, 6, 6) and joint.sum().item() == pytest.approx(1.0)
    T.assert_same_distribution(samples, joint, name="three target tokens")
    T.assert_same_distribution(samples[:, 0], joint.sum((1, 2)), name="first token")


def test_greedy_target_follows_argmax():
    target = T.ToyLM.random(5, generator=_gen(7))
    out = T.greedy_target(target, num_tokens=4, x0=torch.arange(5), num_requests=5)
    best = target.transition_logits.argmax(-1)
    assert torch.equal(out[:, 0], best) and torch.equal(out[:, 1:], best[out[:, :-1]])


def test_throughput_policies_reproduce_appendix_a_decisions():
    ex = T.appendix_a()
    prop = Proposal(
        tokens=torch.tensor([[0, 0], [1, 0]]),
        lengths=torch.tensor([2, 2]),
        confidence=torch.tensor([[0.8, 0.9], [0.8, 0.0]]),
    )
    assert ex.causal_policy()(prop).tolist() == [0, 0]
    assert ex.retrospective_policy()(prop).tolist() == [2, 0]
    drafted = ex.drafter.propose(torch.tensor([ex.anchor, ex.anchor]), 2, _gen(8))
    assert torch.allclose(drafted.confidence[:, 0], torch.tensor(0.8))
    assert torch.equal(drafted.confidence[:, 1], ex.drafter.confidence_table[drafted.tokens[:, 0]])


def test_random_tree_layout():
    drafter = T.ToyDrafter(T.ToyLM.random(8, generator=_gen(9)))
    tree = T.random_tree(drafter, torch.arange(6), depth=3, branching=2, generator=_gen(10))
    assert tree.tokens.shape == (6, 14) and tree.parents.shape == (6, 14)
    full = T.random_tree(drafter, torch.arange(6), depth=3, branching=2, generator=_gen(10), ragged=False)
    assert full.parents[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert bool((full.parents < torch.arange(1, 15)).all())  # parents precede children
    siblings = full.tokens.reshape(6, 7, 2)  # children of one node are adjacent pairs
    assert bool((siblings[..., 0] != siblings[..., 1]).all())
    for r in range(6):
        n = int(tree.num_nodes[r])
        assert bool((tree.tokens[r, n:] == -1).all()) and bool((tree.tokens[r, :n] >= 0).all())


def test_structural_checks_catch_a_broken_verifier():
    target = T.ToyLM.random(6, generator=_gen(11))
    drafter = T.ToyDrafter(T.ToyLM.random(6, generator=_gen(12)))

    def accept_all_but_wrong_tokens(target_probs, draft_tokens, draft_probs, num_draft, **kw):
        res = verify_chain(target_probs, draft_tokens, draft_probs, num_draft, **kw)
        return VerifyResult(res.accepted, res.tokens.where(res.tokens < 0, (res.tokens + 1) % 6), res.num_tokens)

    run = dict(num_requests=100, gamma=3, num_tokens=4, generator=_gen(13))
    with pytest.raises(AssertionError, match="differ from the drafts"):
        T.simulate_speculative(target, drafter, verifier=accept_all_but_wrong_tokens, **run)
    with pytest.raises(AssertionError, match="length_policy"):
        T.simulate_speculative(target, drafter, length_policy=lambda p: p.lengths + 1, **run)
    assert T.simulate_speculative(target, drafter, length_policy=T.fixed_length_policy(0), **run).min() >= 0
