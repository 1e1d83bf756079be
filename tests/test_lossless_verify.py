"""Statistical losslessness of the verifier (docs/verification.md).

Every case simulates 200,000 independent requests through multi-round speculative decoding
with toy Markov-chain models and compares the first committed token and the first two
committed tokens with the exact target distribution by chi-square. Seeds are fixed, so the
suite is deterministic; alpha = 1e-5 keeps the chance that a change in how the verifier draws
its randomness trips a correct case below ~0.2% per run, while a real bias at this sample
size gives p < 1e-12. Deliberately wrong verifiers and the retrospective scheduler of the
paper's Appendix A must fail the same check.
"""

import pytest
import torch

import dspec_cli.runtime.verify.block as block_verify
import dspec_cli.runtime.verify.reference as reference
import dspec_cli.runtime.verify.traversal as traversal_verify
import dspec_cli.runtime.verify.tree as tree_verify
from dspec_cli import testing as T
from dspec_cli.core.sampling import torch_uniform
from dspec_cli.runtime.verify import verify_chain, verify_greedy

R = 200_000
V = 8
ALPHA = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dirichlet(n: int, seed: int) -> torch.Tensor:
    e = -torch.rand(n, generator=_gen(seed), dtype=torch.float64).log()
    return e / e.sum()


def _logits(seed: int, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(V, generator=_gen(seed))


def _peaked(top: int) -> torch.Tensor:
    return torch.full((V,), -1.0).index_fill(0, torch.tensor([top]), 3.0)


# (target, drafter) pairs with fixed p, q at every position (i.i.d. sources).
IID_CASES = {
    "dirichlet": lambda: (T.ToyLM.from_probs(_dirichlet(V, 1)), T.ToyDrafter(T.ToyLM.from_probs(_dirichlet(V, 2)))),
    "peaked": lambda: (T.ToyLM.iid(_peaked(0)), T.ToyDrafter(T.ToyLM.iid(_peaked(1)))),
    "disjoint": lambda: (
        T.ToyLM.from_probs(torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])),
        T.ToyDrafter(T.ToyLM.from_probs(torch.tensor([0, 0, 0, 0, 0.1, 0.2, 0.3, 0.4]))),
    ),
    "identical": lambda: (T.ToyLM.from_probs(_dirichlet(V, 3)), T.ToyDrafter(T.ToyLM.from_probs(_dirichlet(V, 3)))),
    "target_top_k": lambda: (T.ToyLM.iid(_logits(4), top_k=3), T.ToyDrafter(T.ToyLM.iid(_logits(5)))),
    "draft_top_k": lambda: (T.ToyLM.iid(_logits(6)), T.ToyDrafter(T.ToyLM.iid(_logits(7), top_k=2))),
    "target_top_p": lambda: (T.ToyLM.iid(_logits(8), top_p=0.8), T.ToyDrafter(T.ToyLM.iid(_logits(9), top_p=0.7))),
    "t0.7_top_p0.9": lambda: (
        T.ToyLM.iid(_logits(10), temperature=0.7, top_p=0.9),
        T.ToyDrafter(T.ToyLM.iid(_logits(11), temperature=1.3, top_k=5)),
    ),
    "one_hot_draft": lambda: (T.ToyLM.iid(_logits(12)), T.ToyDrafter(T.ToyLM.iid(_logits(13)), greedy=True)),
}


def _assert_first_two(tokens: torch.Tensor, target: T.ToyLM, x0: int, name: str) -> None:
    joint = T.exact_target_joint(target, x0, 2)
    T.assert_same_distribution(tokens[:, 0], joint.sum(1), alpha=ALPHA, name=f"{name}: first token")
    T.assert_same_distribution(tokens, joint, alpha=ALPHA, name=f"{name}: first two tokens")


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("case", list(IID_CASES))
def test_chain_iid(case, gamma):
    target, drafter = IID_CASES[case]()
    seed = 1000 * gamma + list(IID_CASES).index(case)
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=gamma, num_tokens=2, generator=_gen(seed), backend="torch"
    )
    _assert_first_two(tokens, target, 0, f"{case}, γ={gamma}")


def _inverse_cdf_verifier(target_probs, draft_tokens, draft_probs, num_draft, *, generator=None, draw=None, **kw):
    """verify_chain drawing the final token by inverse CDF (the engine's CPU path); ``draw`` bends the uniforms."""
    u = torch_uniform((num_draft.numel(),), generator=generator)
    return verify_chain(target_probs, draft_tokens, draft_probs, num_draft, generator=generator,
                        final_uniforms=u if draw is None else draw(u), **kw)


@pytest.mark.parametrize("case", ["dirichlet", "disjoint", "target_top_p", "one_hot_draft"])
def test_chain_final_token_by_inverse_cdf(case):
    target, drafter = IID_CASES[case]()
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=3, num_tokens=2, generator=_gen(300 + list(IID_CASES).index(case)),
        verifier=_inverse_cdf_verifier, backend="torch",
    )
    _assert_first_two(tokens, target, 0, f"{case}, inverse CDF")


def test_biased_inverse_cdf_draw_is_caught():
    target, drafter = IID_CASES["disjoint"]()  # every draft is rejected: the final draw is every token
    kw = dict(num_requests=R, gamma=3, num_tokens=1, backend="torch")
    ok = T.simulate_speculative(target, drafter, generator=_gen(310), verifier=_inverse_cdf_verifier, **kw)
    assert T.gof_test(ok[:, 0], T.exact_target_joint(target, 0, 1)).p_value > 1e-4  # control
    bent = lambda *a, **k: _inverse_cdf_verifier(*a, draw=lambda u: u.sqrt(), **k)  # noqa: E731
    tokens = T.simulate_speculative(target, drafter, generator=_gen(310), verifier=bent, **kw)
    assert T.gof_test(tokens[:, 0], T.exact_target_joint(target, 0, 1)).p_value < 1e-12


def _markov(seed: int, target_sampling: dict, drafter_sampling: dict, greedy: bool = False, vocab: int = 16):
    g = _gen(seed)
    target = T.ToyLM.random(vocab, generator=g, **target_sampling)
    drafter = T.ToyDrafter(T.ToyLM.random(vocab, scale=1.5, generator=g, **drafter_sampling), greedy=greedy)
    return target, drafter


MARKOV_CASES = {
    "plain": dict(gamma=3, target_sampling={}, drafter_sampling={}),
    "t0.7_top_p0.9": dict(gamma=7, target_sampling=dict(temperature=0.7, top_p=0.9), drafter_sampling=dict(temperature=1.2, top_k=8)),
    "top_k_one_hot": dict(gamma=3, target_sampling=dict(top_k=5), drafter_sampling={}, greedy=True),
    "random_lengths": dict(gamma=7, target_sampling={}, drafter_sampling={}, policy="random"),
    # a peaked drafter and a flat SPS curve, so the causal scheduler picks ℓ from 1 to 7
    "causal_throughput": dict(gamma=7, target_sampling=dict(top_p=0.95), drafter_sampling=dict(temperature=0.4), policy="throughput"),
}


@pytest.mark.parametrize("case", list(MARKOV_CASES))
def test_chain_markov(case):
    spec = dict(MARKOV_CASES[case])
    seed = 50 + list(MARKOV_CASES).index(case)
    gamma, policy = spec.pop("gamma"), spec.pop("policy", None)
    target, drafter = _markov(seed, **spec)
    length_policy = {
        None: None,
        "random": T.random_length_policy(_gen(seed + 1)),
        "throughput": T.throughput_length_policy([1.0, 0.9, 0.84, 0.8, 0.77, 0.75, 0.73, 0.72]),
    }[policy]
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=gamma, num_tokens=2, x0=3,
        length_policy=length_policy, generator=_gen(seed), backend="torch",
    )
    _assert_first_two(tokens, target, 3, case)


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("seed", range(12))
def test_chain_iid_random_sweep(seed, gamma):
    vocab = 4 + seed % 3 * 6  # 4, 10, 16
    scale = (0.5, 2.0, 4.0)[seed % 3]
    target = T.ToyLM.iid(scale * torch.randn(vocab, generator=_gen(seed)), top_p=(1.0, 0.9, 0.8)[seed % 3])
    drafter = T.ToyDrafter(T.ToyLM.iid(scale * torch.randn(vocab, generator=_gen(100 + seed))))
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=gamma, num_tokens=2, generator=_gen(200 + seed), backend="torch"
    )
    _assert_first_two(tokens, target, 0, f"sweep {seed}, γ={gamma}")


def test_chain_markov_three_tokens_over_many_rounds():
    target, drafter = _markov(60, dict(temperature=0.9), {}, vocab=6)
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=3, num_tokens=3, x0=2,
        length_policy=T.random_length_policy(_gen(61)), generator=_gen(62), backend="torch",
    )
    T.assert_same_distribution(tokens, T.exact_target_joint(target, 2, 3), alpha=ALPHA, name="first three tokens")


def _greedy_verifier(target_probs, draft_tokens, draft_probs, num_draft, *, generator=None, **kw):
    # at T = 0 the target rows are one-hot on the logits' argmax, so they stand in for logits
    return verify_greedy(target_probs, draft_tokens, num_draft, **kw)


@pytest.mark.parametrize("verifier", ["chain", "block", "greedy"])
@pytest.mark.parametrize("drafter_greedy", [False, True])
def test_greedy_target_is_reproduced_exactly(verifier, drafter_greedy):
    target, drafter = _markov(70, dict(temperature=0.0), {}, greedy=drafter_greedy)
    anchors = torch.arange(2000) % 16
    kw = dict(method="block") if verifier == "block" else {}
    tokens = T.simulate_speculative(
        target, drafter, num_requests=2000, gamma=4, num_tokens=12, x0=anchors,
        verifier=_greedy_verifier if verifier == "greedy" else verify_chain,
        generator=_gen(71), backend="torch", **kw,
    )
    assert torch.equal(tokens, T.greedy_target(target, num_tokens=12, x0=anchors, num_requests=2000))


@pytest.mark.parametrize("method", ["match", "recursive"])
@pytest.mark.parametrize("shape", [(3, 2), (2, 3)])
def test_tree(method, shape):
    depth, branching = shape
    seed = 80 + 10 * depth + branching + (method == "recursive")
    target, drafter = _markov(seed, dict(temperature=0.8, top_p=0.95), {}, vocab=V)
    tokens = T.simulate_tree_speculative(
        target, drafter, num_requests=R, depth=depth, branching=branching, num_tokens=2, x0=1,
        method=method, generator=_gen(seed),
    )
    _assert_first_two(tokens, target, 1, f"tree {method} {shape}")


# --------------------------------------------------------------------------------------
# The harness must catch wrong verifiers and anticipating schedulers.
# --------------------------------------------------------------------------------------

AB_CASE = lambda: (  # noqa: E731 - the Appendix A distributions (0.7, 0.3) vs (0.5, 0.5)
    T.ToyLM.from_probs(torch.tensor([0.7, 0.3])),
    T.ToyDrafter(T.ToyLM.from_probs(torch.tensor([0.5, 0.5]))),
)
BIAS_CASES = {"ab": AB_CASE, "dirichlet": IID_CASES["dirichlet"]}


def _first_token_p_value(case: str, seed: int) -> float:
    target, drafter = BIAS_CASES[case]()
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=3, num_tokens=1, generator=_gen(seed), backend="torch"
    )
    return T.gof_test(tokens[:, 0], T.exact_target_joint(target, 0, 1)).p_value


@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_wrong_acceptance_ratio_is_caught(case, monkeypatch):
    assert _first_token_p_value(case, 90) > 1e-4  # control: the real verifier passes
    monkeypatch.setattr(reference, "acceptance_prob", lambda p_x, q_x: (q_x / p_x).clamp(max=1.0))
    assert _first_token_p_value(case, 90) < 1e-12


def test_wrong_tree_acceptance_is_caught(monkeypatch):
    target, drafter = _markov(97, {}, {}, vocab=V)
    monkeypatch.setattr(reference, "acceptance_prob", lambda p_x, q_x: (q_x / p_x).clamp(max=1.0))
    tokens = T.simulate_tree_speculative(
        target, drafter, num_requests=R, depth=2, branching=2, num_tokens=1, x0=1, method="recursive",
        generator=_gen(98),
    )
    assert T.gof_test(tokens[:, 0], T.exact_target_joint(target, 1, 1)).p_value < 1e-12


@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_wrong_residual_is_caught(case, monkeypatch):
    monkeypatch.setattr(reference, "residual", lambda p, q: p)
    assert _first_token_p_value(case, 91) < 1e-12


def test_appendix_a_retrospective_scheduler_is_caught():
    ex = T.appendix_a()

    def run(policy, seed):
        return T.simulate_speculative(
            ex.target, ex.drafter, num_requests=R, gamma=ex.gamma, num_tokens=2, x0=ex.anchor,
            length_policy=policy, generator=_gen(seed), backend="torch",
        )

    causal = run(ex.causal_policy(), 95)
    _assert_first_two(causal, ex.target, ex.anchor, "appendix A, causal early stop")
    retro = run(ex.retrospective_policy(), 96)
    assert T.gof_test(retro[:, 0], ex.target_first).p_value < 1e-12
    with pytest.raises(AssertionError, match="distribution mismatch"):
        T.assert_same_distribution(retro[:, 0], ex.target_first, name="appendix A, retrospective")
    T.assert_same_distribution(retro[:, 0], ex.retrospective_first, alpha=ALPHA, name="the paper's (0.85, 0.15)")


# --------------------------------------------------------------------------------------
# Sampled trees: siblings drawn without replacement from q, verified with q ("sampled").
# --------------------------------------------------------------------------------------

SAMPLED_CASES = {  # (target, drafter) Markov chains at T = 1 unless stated
    "broad": lambda: (T.ToyLM.random(V, scale=0.5, generator=_gen(120)), T.ToyDrafter(T.ToyLM.random(V, scale=0.5, generator=_gen(121)))),
    "peaked": lambda: (T.ToyLM.random(V, scale=4.0, generator=_gen(122)), T.ToyDrafter(T.ToyLM.random(V, scale=4.0, generator=_gen(123)))),
    # q's support (top-k 2) is exhausted by 3 siblings: the third is verified as a one-hot draft
    "draft_top_k": lambda: (T.ToyLM.random(V, generator=_gen(124)), T.ToyDrafter(T.ToyLM.random(V, generator=_gen(125), top_k=2))),
    "target_top_p": lambda: (T.ToyLM.random(V, generator=_gen(126), top_p=0.8), T.ToyDrafter(T.ToyLM.random(V, generator=_gen(127)))),
    "identical": lambda: (T.ToyLM.random(V, generator=_gen(128)), T.ToyDrafter(T.ToyLM.random(V, generator=_gen(128)))),
    "t0.7_top_p0.9": lambda: (
        T.ToyLM.random(V, generator=_gen(129), temperature=0.7, top_p=0.9),
        T.ToyDrafter(T.ToyLM.random(V, generator=_gen(130), temperature=1.2)),
    ),
}


def _sampled_tree_tokens(case: str, shape, seed: int, num_tokens: int = 2, num_requests: int = R,
                         method: str = "sampled", **verify_kwargs) -> torch.Tensor:
    target, drafter = SAMPLED_CASES[case]()
    depth, branching = shape
    return T.simulate_tree_speculative(
        target, drafter, num_requests=num_requests, depth=depth, branching=branching, num_tokens=num_tokens, x0=1,
        method=method, generator=_gen(seed), **verify_kwargs,
    )


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)])
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_tree_sampled(case, shape):
    seed = 130 + 10 * list(SAMPLED_CASES).index(case) + shape[1]
    tokens = _sampled_tree_tokens(case, shape, seed)
    _assert_first_two(tokens, SAMPLED_CASES[case]()[0], 1, f"tree sampled {case} {shape}")


@pytest.mark.parametrize("method", ["match", "sampled"])
def test_tree_target_draws_by_inverse_cdf(method):
    """The engine's CPU path: one uniform per depth instead of a vocabulary-wide noise vector."""
    if method == "sampled":
        tokens, target = _sampled_tree_tokens("broad", (2, 3), 200, final_draw="inverse_cdf"), SAMPLED_CASES["broad"]()[0]
    else:
        target, drafter = _markov(201, dict(temperature=0.8), {}, vocab=V)
        tokens = T.simulate_tree_speculative(target, drafter, num_requests=R, depth=2, branching=3, num_tokens=2, x0=1,
                                             method="match", generator=_gen(201), final_draw="inverse_cdf")
    _assert_first_two(tokens, target, 1, f"tree {method}, inverse CDF")


def test_biased_tree_inverse_cdf_draw_is_caught(monkeypatch):
    import dspec_cli.runtime.verify.tree as tree_module

    assert _sampled_first_token_p_value("broad", 202, final_draw="inverse_cdf") > 1e-4  # control
    bent = tree_module.sample_inverse_cdf
    monkeypatch.setattr(tree_module, "sample_inverse_cdf", lambda w, u: bent(w, u.sqrt()))
    assert _sampled_first_token_p_value("broad", 202, final_draw="inverse_cdf") < 1e-12


def _sampled_first_token_p_value(case: str, seed: int, **verify_kwargs) -> float:
    tokens = _sampled_tree_tokens(case, (2, 3), seed, num_tokens=1, **verify_kwargs)
    return T.gof_test(tokens[:, 0], T.exact_target_joint(SAMPLED_CASES[case]()[0], 1, 1)).p_value


_SIBLING_REJECT = tree_verify.sibling_reject


def _reject_keeping_rejected_in_q(p, q, x):
    return _SIBLING_REJECT(p, q, x)[0], q  # q' not updated: later siblings are checked against the wrong q̂'


def _accept_unnormalised(p, q, x):
    p_x, q_x = p.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
    return reference.acceptance_prob(p_x, q_x)  # min(1, p'/q') without the hats


SAMPLED_BIASES = {
    "residual_is_p": lambda mp: mp.setattr(reference, "residual", lambda p, q: p),
    "rejected_kept_in_q": lambda mp: mp.setattr(tree_verify, "sibling_reject", _reject_keeping_rejected_in_q),
    "unnormalised_ratio": lambda mp: mp.setattr(tree_verify, "sibling_accept", _accept_unnormalised),
}


@pytest.mark.parametrize("bias", list(SAMPLED_BIASES))
def test_wrong_sampled_tree_verification_is_caught(bias, monkeypatch):
    assert _sampled_first_token_p_value("broad", 190) > 1e-4  # control: the real verifier passes
    SAMPLED_BIASES[bias](monkeypatch)
    assert _sampled_first_token_p_value("broad", 190) < 1e-12


# --------------------------------------------------------------------------------------
# Block verification of chains (verify_chain(method="block")).
# --------------------------------------------------------------------------------------

BLOCK_CASES = ["dirichlet", "t0.7_top_p0.9"]


def _block_tokens(case: str, gamma: int, seed: int, num_tokens: int = 2, **kw) -> torch.Tensor:
    target, drafter = IID_CASES[case]()
    return T.simulate_speculative(target, drafter, num_requests=R, gamma=gamma, num_tokens=num_tokens,
                                  generator=_gen(seed), backend="torch", method="block", **kw)


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_chain_block_iid(case, gamma):
    tokens = _block_tokens(case, gamma, 400 + 10 * gamma + BLOCK_CASES.index(case))
    _assert_first_two(tokens, IID_CASES[case]()[0], 0, f"block {case}, γ={gamma}")


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [2, 4, 7])
@pytest.mark.parametrize("case", [c for c in IID_CASES if c not in BLOCK_CASES])
def test_chain_block_iid_sweep(case, gamma):
    tokens = _block_tokens(case, gamma, 500 + 10 * gamma + list(IID_CASES).index(case))
    _assert_first_two(tokens, IID_CASES[case]()[0], 0, f"block {case}, γ={gamma}")


@pytest.mark.parametrize("case", ["t0.7_top_p0.9", "causal_throughput"])
def test_chain_block_markov(case):
    spec = dict(MARKOV_CASES[case])
    seed = 450 + list(MARKOV_CASES).index(case)
    gamma, policy = spec.pop("gamma"), spec.pop("policy", None)
    target, drafter = _markov(seed, **spec)
    length_policy = T.throughput_length_policy([1.0, 0.9, 0.84, 0.8, 0.77, 0.75, 0.73, 0.72]) if policy else None
    tokens = T.simulate_speculative(
        target, drafter, num_requests=R, gamma=gamma, num_tokens=2, x0=3, length_policy=length_policy,
        generator=_gen(seed), backend="torch", method="block",
    )
    _assert_first_two(tokens, target, 3, f"block {case}")


def test_chain_block_final_token_by_inverse_cdf():
    tokens = _block_tokens("dirichlet", 3, 460, verifier=_inverse_cdf_verifier)
    _assert_first_two(tokens, IID_CASES["dirichlet"]()[0], 0, "block, inverse CDF")


def _token_rule_weights(p_x, q_x):
    ratio = torch.where(q_x > 0, p_x.double() / q_x.double(), 1.0).clamp(max=1.0)
    return torch.cat([torch.ones_like(ratio[:, :1]), ratio.cumprod(1)], 1)  # Π min(1, p/q): no carry-over


def _stop_without_denominator(rho, mass, num_draft):
    k = torch.arange(1, mass.shape[1] + 1)
    z = torch.cat([mass[:, 1:], torch.zeros_like(mass[:, :1])], 1)
    return torch.where(k < num_draft[:, None], z, torch.where(k == num_draft[:, None], rho[:, 1:], 0.0))


BLOCK_BIASES = {  # each a plausible slip in implementing the paper's Algorithm 2
    "residual_without_weight": ("residual_weights", lambda p, q, rho: (p.float() - q.float()).clamp(min=0)),
    "stop_without_denominator": ("stop_probs", _stop_without_denominator),
    "token_rule_weights": ("prefix_weights", _token_rule_weights),
}


@pytest.mark.parametrize("bias", list(BLOCK_BIASES))
def test_wrong_block_verification_is_caught(bias, monkeypatch):
    monkeypatch.setattr(block_verify, *BLOCK_BIASES[bias])
    tokens = _block_tokens("dirichlet", 3, 470, num_tokens=1)
    assert T.gof_test(tokens[:, 0], T.exact_target_joint(IID_CASES["dirichlet"]()[0], 0, 1)).p_value < 1e-12


# --------------------------------------------------------------------------------------
# Traversal verification of sampled trees (verify_tree(method="traversal")).
# --------------------------------------------------------------------------------------

TRAVERSAL_DEFAULT = [("broad", (3, 2)), ("t0.7_top_p0.9", (2, 3)), ("draft_top_k", (2, 3)), ("peaked", (4, 1))]


@pytest.mark.parametrize("case,shape", TRAVERSAL_DEFAULT)
def test_tree_traversal(case, shape):
    tokens = _sampled_tree_tokens(case, shape, 600 + 10 * list(SAMPLED_CASES).index(case) + shape[1], method="traversal")
    _assert_first_two(tokens, SAMPLED_CASES[case]()[0], 1, f"tree traversal {case} {shape}")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (4, 1), (2, 5)])
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_tree_traversal_sweep(case, shape):
    if (case, shape) in TRAVERSAL_DEFAULT:
        pytest.skip("in the default suite")
    tokens = _sampled_tree_tokens(case, shape, 700 + 10 * list(SAMPLED_CASES).index(case) + shape[1], method="traversal")
    _assert_first_two(tokens, SAMPLED_CASES[case]()[0], 1, f"tree traversal {case} {shape}")


def test_tree_traversal_by_inverse_cdf():
    tokens = _sampled_tree_tokens("broad", (2, 3), 650, method="traversal", final_draw="inverse_cdf")
    _assert_first_two(tokens, SAMPLED_CASES["broad"]()[0], 1, "tree traversal, inverse CDF")


def test_tree_traversal_at_temperature_zero_is_greedy():
    target, drafter = _markov(660, dict(temperature=0.0), dict(temperature=0.0), vocab=V)
    anchors = torch.arange(3000) % V
    tokens = T.simulate_tree_speculative(target, drafter, num_requests=3000, depth=3, branching=2, num_tokens=8,
                                         x0=anchors, method="traversal", generator=_gen(661))
    assert torch.equal(tokens, T.greedy_target(target, num_tokens=8, x0=anchors, num_requests=3000))


TRAVERSAL_BIASES = {  # each a plausible slip in carrying block verification down a tree
    "no_rescale": ("rescale", lambda r, n, z: (r, z)),  # forgets to condition on the failed child
    "enter_with_pass_prob": ("enter_probs", lambda pi, later: pi),  # forgets that the parent passes
    "rejected_kept_in_q": ("proposal", lambda q, x: (traversal_verify.normalised(q),) * 2),
}


@pytest.mark.parametrize("bias", list(TRAVERSAL_BIASES))
def test_wrong_traversal_verification_is_caught(bias, monkeypatch):
    monkeypatch.setattr(traversal_verify, *TRAVERSAL_BIASES[bias])
    tokens = _sampled_tree_tokens("broad", (3, 2), 690, method="traversal")
    joint = T.exact_target_joint(SAMPLED_CASES["broad"]()[0], 1, 2)
    assert T.gof_test(tokens, joint).p_value < 1e-12
