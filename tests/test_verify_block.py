"""Block verification of chains (``verify_chain(method="block")``): a per-request oracle of the
paper's Algorithm 2, both backends (Triton in the interpreter), edge cases and bad input. The
chi-square tests against target sampling live in test_lossless_verify.py."""

import pytest
import torch
from test_verify import BACKENDS, as_lists, make_chain

from dspec_cli.core.sampling import logits_to_probs, torch_exponential, torch_uniform
from dspec_cli.runtime.verify import CHAIN_METHODS, verify_chain, verify_greedy


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton":  # CPU tensors: kernels run in the Triton interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def oracle_block(target_probs, draft_tokens, draft_probs, num_draft, uniforms, noise):
    """Per-request python loop of block verification (float64 weights and masses)."""
    out, row, d = [], 0, 0
    for r, n in enumerate(num_draft.tolist()):
        rho, tau, rho_tau = 1.0, 0, 1.0
        for k in range(n):  # after draft k: ρ_{k+1}, then h_{k+1}
            x = int(draft_tokens[d + k])
            p_x, q_x = float(target_probs[row + k, x]), float(draft_probs[d + k, x])
            rho = min(1.0, rho * p_x / q_x) if q_x > 0 else (1.0 if p_x > 0 and rho > 0 else 0.0)
            if k + 1 < n:
                z = float((rho * target_probs[row + k + 1].double() - draft_probs[d + k + 1].double()).clamp(min=0).sum())
                h = z / (z + 1 - rho) if z + 1 - rho > 0 else 1.0
            else:
                h = rho
            if float(uniforms[d + k]) < h:
                tau, rho_tau = k + 1, rho
        p_row = target_probs[row + tau].float()
        if tau < n:
            res = (torch.tensor(rho_tau).float() * p_row - draft_probs[d + tau].float()).clamp(min=0)
            p_row = res if (res > 0).any() else p_row
        out.append([int(t) for t in draft_tokens[d : d + tau]] + [int((p_row / noise[r]).argmax())])
        row, d = row + n + 1, d + n
    return out


@pytest.mark.parametrize("closeness", [0.3, 1.0])
@pytest.mark.parametrize("lengths,V", [([0], 7), ([0, 0, 0], 50), ([3, 0, 5, 1, 2], 11), ([4], 1000), ([7, 2], 333)])
def test_block_matches_oracle(backend, lengths, V, closeness):
    inputs = make_chain(lengths, V, seed=len(lengths) + V, closeness=closeness)
    result = verify_chain(**inputs, method="block", backend=backend)
    R = len(lengths)
    assert result.tokens.shape == (R, max(lengths) + 1)
    assert torch.equal(result.num_tokens, result.accepted + 1)
    cols = torch.arange(result.tokens.shape[1])
    assert (result.tokens[cols >= result.num_tokens[:, None]] == -1).all()
    assert as_lists(result) == oracle_block(**inputs)


def test_block_accepts_what_token_verification_rejects():
    """The paper's §2 example: p = (1/3, 2/3), q = (2/3, 1/3), γ = 2. Token verification rejects
    a first draft a with probability 1/2; block verification keeps the block (a, b) whenever its
    joint ratio allows: E[accepted] = 10/9 token by token, 11/9 as a block."""
    N, g = 200_000, torch.Generator().manual_seed(0)
    p, q = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    drafts = torch.multinomial(q.expand(2 * N, 2), 1, generator=g).squeeze(1)
    args = (p.expand(3 * N, 2).contiguous(), drafts, q.expand(2 * N, 2).contiguous(), torch.full((N,), 2))
    token = verify_chain(*args, generator=torch.Generator().manual_seed(1), backend="torch")
    block = verify_chain(*args, method="block", generator=torch.Generator().manual_seed(1), backend="torch")
    assert abs(token.accepted.double().mean() - 10 / 9) < 0.01
    assert abs(block.accepted.double().mean() - 11 / 9) < 0.01


def test_block_accepts_at_least_as_many_drafts():
    """P(τ >= k | x_≤k) = ρ_k >= Π_{j<=k} min(1, p/q) (averaged over the later drafts): for drafts
    drawn from q, every P(τ >= k) is at least token verification's."""
    N, gamma, V = 50_000, 6, 40
    g = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 2, -1)  # the same p_k, q_k in every block
    q = torch.softmax(torch.log(p[:gamma]) + torch.randn(gamma, V, generator=g), -1)
    drafts = torch.stack([torch.multinomial(q[k], N, replacement=True, generator=g) for k in range(gamma)], 1)
    args = (p.repeat(N, 1), drafts.flatten(), q.repeat(N, 1), torch.full((N,), gamma))
    at_least = []
    for method in CHAIN_METHODS:
        accepted = verify_chain(*args, method=method, generator=torch.Generator().manual_seed(9)).accepted
        at_least.append(torch.stack([(accepted >= k).double().mean() for k in range(1, gamma + 1)]))
    assert (at_least[1] >= at_least[0] - 0.005).all()
    assert at_least[1].sum() > at_least[0].sum() + 0.05


def test_block_at_temperature_zero_is_greedy(backend):
    """One-hot p and q: τ is the number of leading drafts equal to the argmax (as greedy)."""
    g = torch.Generator().manual_seed(3)
    lengths, V = [5, 0, 3, 7], 20
    num_draft = torch.tensor(lengths)
    total = sum(lengths)
    logits = torch.randn(total + len(lengths), V, generator=g)
    best = logits.argmax(-1)
    is_draft = torch.ones(total + len(lengths), dtype=torch.bool)
    is_draft[num_draft.cumsum(0) + torch.arange(len(lengths))] = False
    follow = torch.rand(total, generator=g) < 0.7
    drafts = torch.where(follow, best[is_draft], torch.randint(0, V, (total,), generator=g))
    q = logits_to_probs(torch.nn.functional.one_hot(drafts, V).float(), 0.0)  # the greedy drafter's one-hot q
    block = verify_chain(logits_to_probs(logits, 0.0), drafts, q, num_draft, method="block", backend=backend,
                         uniforms=torch_uniform((total,), generator=g), noise=torch_exponential((len(lengths), V), generator=g))
    greedy = verify_greedy(logits, drafts, num_draft)
    assert torch.equal(block.accepted, greedy.accepted) and torch.equal(block.tokens, greedy.tokens)


def test_block_without_draft_probs_is_token_verification():
    inputs = make_chain([3, 0, 5], 11, seed=4, one_hot=True)
    assert as_lists(verify_chain(**inputs, method="block")) == as_lists(verify_chain(**inputs))


def test_block_final_token_by_inverse_cdf():
    inputs = make_chain([3, 0, 5], 11, seed=5)
    inputs.pop("noise")
    u = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    result = verify_chain(**inputs, method="block", final_uniforms=u, backend="torch")
    assert torch.equal(result.num_tokens, result.accepted + 1)
    assert ((result.tokens >= 0).sum(1) == result.num_tokens).all()


def test_block_counter_randomness_is_batch_independent():
    inputs = make_chain([4, 0, 6, 2], 30, seed=6)
    del inputs["uniforms"], inputs["noise"]
    seeds, offsets = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 100, 7, 64])
    full = verify_chain(**inputs, method="block", seeds=seeds, offsets=offsets)
    # request 2 alone: target rows 6..12, drafts 4..9
    alone = verify_chain(inputs["target_probs"][6:13], inputs["draft_tokens"][4:10], inputs["draft_probs"][4:10],
                         inputs["num_draft"][2:3], method="block", seeds=seeds[2:3], offsets=offsets[2:3])
    assert as_lists(alone) == as_lists(full)[2:3]


def test_unknown_method_names_argument():
    inputs = make_chain([2], 5, seed=7)
    with pytest.raises(ValueError, match="^method"):
        verify_chain(**inputs, method="blocks")
