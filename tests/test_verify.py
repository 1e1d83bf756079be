"""Chain and greedy verification: edge cases (torch and Triton-interpreter backends) and bad input."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dspec_cli.core.sampling import (
    NOISE_SALT,
    exponential,
    logits_to_probs,
    torch_exponential,
    torch_uniform,
)
from dspec_cli.runtime.verify import (
    reference,
    triton_available,
    verify_chain,
    verify_greedy,
)

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="triton not installed")),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py)")
    return request.param


def make_chain(lengths, V, *, seed=0, one_hot=False, closeness=1.0):
    """Random ragged chain inputs; drafts are sampled from q, the target is q's logits plus noise."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.tensor(lengths, dtype=torch.long)
    total, R = int(num_draft.sum()), len(lengths)
    rows = torch.randn(total + R, V, generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (num_draft + 1).cumsum(0)[:-1]])
    draft_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths, strict=True)]) if total else starts[:0]
    draft_logits = rows[draft_rows] + closeness * torch.randn(total, V, generator=g)
    draft_probs = torch.softmax(draft_logits, -1)
    draft_tokens = torch.multinomial(draft_probs, 1, generator=g).squeeze(1) if total else torch.zeros(0, dtype=torch.long)
    uniforms = torch_uniform((total,), generator=g)
    noise = torch_exponential((R, V), generator=g)
    return dict(
        target_probs=torch.softmax(rows, -1),
        draft_tokens=draft_tokens,
        draft_probs=None if one_hot else draft_probs,
        num_draft=num_draft,
        uniforms=uniforms,
        noise=noise,
    )


def oracle_chain(target_probs, draft_tokens, draft_probs, num_draft, uniforms, noise):
    """Per-request python loop of the chain rule with the same float arithmetic."""
    out, row, d = [], 0, 0
    for r, n in enumerate(num_draft.tolist()):
        toks, k = [], 0
        while k < n:
            x = int(draft_tokens[d + k])
            p, q = float(target_probs[row + k, x]), 1.0 if draft_probs is None else float(draft_probs[d + k, x])
            prob = (min(1.0, p / q) if q > 0 else float(p > 0))
            if not float(uniforms[d + k]) < prob:
                break
            toks.append(x)
            k += 1
        p_row = target_probs[row + k].float()
        if k < n:
            q_row = torch.zeros_like(p_row)
            if draft_probs is None:
                q_row[int(draft_tokens[d + k])] = 1
            else:
                q_row = draft_probs[d + k].float()
            res = torch.clamp(p_row - q_row, min=0)
            p_row = res if (res > 0).any() else p_row
        toks.append(int((p_row / noise[r]).argmax()))
        out.append(toks)
        row, d = row + n + 1, d + n
    return out


def as_lists(result):
    return [row[:n] for row, n in zip(result.tokens.tolist(), result.num_tokens.tolist(), strict=True)]


def run_chain(inputs, backend, **kw):
    return verify_chain(**inputs, backend=backend, **kw)


def check_result(result, inputs):
    """Output invariants plus equality with the oracle."""
    R = inputs["num_draft"].numel()
    assert result.tokens.shape == (R, int(inputs["num_draft"].max()) + 1 if R else 1)
    assert torch.equal(result.num_tokens, result.accepted + 1)
    assert (result.accepted <= inputs["num_draft"]).all()
    cols = torch.arange(result.tokens.shape[1])
    assert (result.tokens[cols >= result.num_tokens[:, None]] == -1).all()
    assert as_lists(result) == oracle_chain(**inputs)


# --------------------------------------------------------------------------------------
# chain edge cases
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("lengths,V", [([0], 7), ([0, 0, 0], 50), ([3, 0, 5, 1, 2], 11), ([4], 1000), ([7, 2], 333)])
def test_chain_matches_oracle(backend, lengths, V, one_hot):
    inputs = make_chain(lengths, V, seed=len(lengths) + V, one_hot=one_hot)
    check_result(run_chain(inputs, backend), inputs)


def test_chain_no_drafts_samples_bonus(backend):
    inputs = make_chain([0, 0], 13, seed=4)
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [0, 0]
    assert torch.equal(result.tokens[:, 0], (inputs["target_probs"] / inputs["noise"]).argmax(-1))


def test_chain_all_accepted_when_p_equals_q(backend):
    inputs = make_chain([3, 5, 1], 17, seed=5)
    rows = torch.cat([torch.arange(0, 3), torch.arange(4, 9), torch.arange(10, 11)])
    inputs["target_probs"][rows] = inputs["draft_probs"]  # p == q: acceptance probability 1
    inputs["uniforms"] = torch.full_like(inputs["uniforms"], 1 - 2**-52)
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [3, 5, 1]
    bonus = inputs["target_probs"][[3, 9, 11]] / inputs["noise"]
    assert torch.equal(result.tokens.gather(1, result.accepted[:, None]).squeeze(1), bonus.argmax(-1))
    check_result(result, inputs)


@pytest.mark.parametrize("one_hot", [False, True])
def test_chain_first_rejected_when_p_of_draft_is_zero(backend, one_hot):
    inputs = make_chain([4, 2], 9, seed=6, one_hot=one_hot)
    p = inputs["target_probs"]
    for row, d in ((0, 0), (5, 4)):  # first draft row of each request
        x = inputs["draft_tokens"][d]
        p[row, x] = 0
        p[row] /= p[row].sum()
    inputs["uniforms"] = torch.full_like(inputs["uniforms"], 2**-53)  # smallest coin still rejects
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [0, 0]
    assert (result.tokens[:, 0] != inputs["draft_tokens"][[0, 4]]).all()
    check_result(result, inputs)


def test_chain_q_zero_is_limit_of_ratio(backend):
    """q(x) = 0 never divides by zero: accepted iff p(x) > 0."""
    V = 6
    q = torch.full((2, V), 0.2)
    q[:, 0] = 0.0  # both drafts are token 0 with q = 0
    p = torch.full((4, V), 1 / V)
    p[2, 0], p[2, 1] = 0.0, 2 / V  # request 1: p(x) = 0 too
    inputs = dict(
        target_probs=p,
        draft_tokens=torch.tensor([0, 0]),
        draft_probs=q,
        num_draft=torch.tensor([1, 1]),
        uniforms=torch.full((2,), 0.999),
        noise=torch.ones(2, V),
    )
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [1, 0]
    check_result(result, inputs)


def test_chain_zero_residual_falls_back_to_p(backend):
    """p slightly below q (still within the row-sum tolerance): max(0, p - q) is all zero."""
    V = 8
    q = torch.softmax(torch.randn(1, V, generator=torch.Generator().manual_seed(7)), -1)
    p = torch.cat([q * (1 - 1e-4), torch.full((1, V), 1 / V)])
    inputs = dict(
        target_probs=p,
        draft_tokens=torch.tensor([int(q.argmax())]),
        draft_probs=q,
        num_draft=torch.tensor([1]),
        uniforms=torch.tensor([1 - 1e-6], dtype=torch.float64),  # above 1 - 1e-4: rejected
        noise=torch_exponential((1, V), generator=torch.Generator().manual_seed(8)),
    )
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [0]
    assert result.tokens[0, 0] == (p[0] / inputs["noise"][0]).argmax()
    check_result(result, inputs)


def test_chain_disjoint_supports(backend):
    V = 10
    q = torch.zeros(3, V)
    q[:, 5:] = 0.2
    p = torch.zeros(4, V)
    p[:, :5] = 0.2
    inputs = dict(
        target_probs=p,
        draft_tokens=torch.tensor([5, 7, 9]),
        draft_probs=q,
        num_draft=torch.tensor([3]),
        uniforms=torch.full((3,), 2**-53, dtype=torch.float64),
        noise=torch_exponential((1, V), generator=torch.Generator().manual_seed(9)),
    )
    result = run_chain(inputs, backend)
    assert result.accepted.tolist() == [0] and 0 <= result.tokens[0, 0] < 5
    check_result(result, inputs)


@pytest.mark.parametrize("one_hot", [False, True])
def test_chain_large_ragged_batch(backend, one_hot):
    lengths = torch.randint(0, 8, (256,), generator=torch.Generator().manual_seed(10)).tolist()
    inputs = make_chain(lengths, 37, seed=11, one_hot=one_hot, closeness=0.3)
    result = run_chain(inputs, backend)
    check_result(result, inputs)
    assert 0 < result.accepted.float().mean() < 7  # a mix of accepts and rejects


def test_chain_r1_full_acceptance_mix(backend):
    inputs = make_chain([16], 101, seed=12, closeness=0.05)
    check_result(run_chain(inputs, backend), inputs)


def test_chain_bf16_inputs(backend):
    inputs = make_chain([3, 2], 24, seed=13)
    inputs["target_probs"] = inputs["target_probs"].bfloat16()
    inputs["draft_probs"] = inputs["draft_probs"].bfloat16()
    result = run_chain(inputs, backend)
    assert as_lists(result) == oracle_chain(**inputs)


# --------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------


def make_greedy(lengths, V, *, seed=0, match_rate=0.7):
    """Logits and drafts that follow the argmax with probability match_rate per position."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.tensor(lengths, dtype=torch.long)
    R, total = len(lengths), int(num_draft.sum())
    logits = torch.randn(total + R, V, generator=g)
    best = logits.argmax(-1)
    drafts, row = [], 0
    for n in lengths:
        for k in range(n):
            hit = torch.rand((), generator=g) < match_rate
            drafts.append(int(best[row + k]) if hit else int(torch.randint(0, V, (), generator=g)))
        row += n + 1
    return logits, torch.tensor(drafts, dtype=torch.long), num_draft


def oracle_greedy(logits, drafts, num_draft):
    out, row, d = [], 0, 0
    for n in num_draft.tolist():
        toks = []
        for k in range(n + 1):
            best = int(logits[row + k].argmax())
            if k < n and int(drafts[d + k]) == best:
                toks.append(best)
                continue
            toks.append(best)
            break
        out.append(toks)
        row, d = row + n + 1, d + n
    return out


@pytest.mark.parametrize("lengths,V", [([0], 5), ([5, 0, 3, 7], 19), ([16] * 3, 1000), ([2, 9], 130)])
def test_greedy_matches_oracle(backend, lengths, V):
    logits, drafts, num_draft = make_greedy(lengths, V, seed=V)
    result = verify_greedy(logits, drafts, num_draft, backend=backend)
    assert as_lists(result) == oracle_greedy(logits, drafts, num_draft)
    assert torch.equal(result.num_tokens, result.accepted + 1)


def test_greedy_ties_take_first_index(backend):
    logits = torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0]])
    result = verify_greedy(logits, torch.tensor([2]), torch.tensor([1]), backend=backend)
    assert result.tokens.tolist() == [[1, -1]]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_chain_at_temperature_zero_equals_greedy(backend, with_draft_probs):
    lengths = torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(14)).tolist()
    logits, drafts, num_draft = make_greedy(lengths, 23, seed=15)
    target = logits_to_probs(logits, 0.0)
    q = None
    if with_draft_probs:
        q = torch.softmax(torch.randn(drafts.numel(), 23, generator=torch.Generator().manual_seed(16)), -1)
    chain = verify_chain(target, drafts, q, num_draft, generator=torch.Generator().manual_seed(17), backend=backend)
    greedy = verify_greedy(logits, drafts, num_draft, backend=backend)
    assert torch.equal(chain.tokens, greedy.tokens) and torch.equal(chain.accepted, greedy.accepted)


# --------------------------------------------------------------------------------------
# randomness sources and the swappable rule
# --------------------------------------------------------------------------------------


def test_counter_randomness_is_batch_independent():
    inputs = make_chain([3, 6, 0, 4], 29, seed=18, closeness=0.5)
    for key in ("uniforms", "noise"):
        inputs.pop(key)
    seeds, offsets = torch.tensor([11, 12, 13, 14]), torch.tensor([100, 7, 0, 55])
    full = verify_chain(**inputs, seeds=seeds, offsets=offsets)
    # request 1 alone gives the same tokens
    single = verify_chain(
        inputs["target_probs"][4:11],
        inputs["draft_tokens"][3:9],
        inputs["draft_probs"][3:9],
        torch.tensor([6]),
        seeds=seeds[1:2],
        offsets=offsets[1:2],
    )
    assert as_lists(single) == as_lists(full)[1:2]
    # and the counter-based draws are exactly the documented ones
    noise = exponential(seeds, offsets, 29, NOISE_SALT)
    again = verify_chain(**inputs, seeds=seeds, offsets=offsets, noise=noise)
    assert torch.equal(again.tokens, full.tokens)


def test_generator_is_reproducible():
    inputs = make_chain([5, 2, 7], 31, seed=19, closeness=0.5)
    for key in ("uniforms", "noise"):
        inputs.pop(key)
    a = verify_chain(**inputs, generator=torch.Generator().manual_seed(3))
    b = verify_chain(**inputs, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)


def test_rule_functions_are_looked_up_at_call_time(monkeypatch):
    inputs = make_chain([4, 4], 12, seed=20, closeness=0.0)
    monkeypatch.setattr(reference, "acceptance_prob", lambda p, q: torch.zeros_like(p, dtype=torch.float64))
    assert run_chain(inputs, "torch").accepted.tolist() == [0, 0]
    monkeypatch.setattr(reference, "residual", lambda p, q: torch.zeros_like(p).index_fill_(1, torch.tensor([3]), 1.0))
    assert run_chain(inputs, "torch").tokens[:, 0].tolist() == [3, 3]


def test_chain_first_token_distribution():
    """Quick sanity check of losslessness (the chi-square tests live with the harness)."""
    V, R = 5, 30_000
    g = torch.Generator().manual_seed(21)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    drafts = torch.multinomial(q, R, replacement=True, generator=g)
    result = verify_chain(p.expand(2 * R, V), drafts, q.expand(R, V), torch.ones(R, dtype=torch.long), generator=g)
    freq = torch.bincount(result.tokens[:, 0], minlength=V).double() / R
    assert torch.allclose(freq, p.double(), atol=0.012)


def test_triton_backend_on_cpu_needs_interpreter():
    if not triton_available():
        pytest.skip("triton not installed")
    code = textwrap.dedent("""
        import os
        import pytest, torch
        from dspec_cli.runtime.verify import verify_greedy
        args = (torch.zeros(1, 4), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        with pytest.raises(ValueError, match="backend: 'triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
            verify_greedy(*args, backend="triton")
        os.environ["TRITON_INTERPRET"] = "1"  # too late: triton is imported
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1 was set after triton was imported"):
            verify_greedy(*args, backend="triton")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_package_works_without_triton():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # make `import triton` fail
        import torch
        from dspec_cli.runtime.verify import triton_available, verify_chain
        assert not triton_available()
        args = (torch.full((3, 4), 0.25), torch.tensor([1, 2]), None, torch.tensor([2]))
        assert verify_chain(*args, generator=torch.Generator()).tokens.shape == (1, 3)
        try:
            verify_chain(*args, backend="triton")
        except ValueError as e:
            assert str(e).startswith("backend"), e
        else:
            raise AssertionError("no error")
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_auto_backend_on_cpu_is_torch():
    inputs = make_chain([2, 3], 9, seed=22)
    assert as_lists(run_chain(inputs, "auto")) == oracle_chain(**inputs)


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------


def _bad(**changes):
    inputs = make_chain([2, 3], 6, seed=23)
    inputs.update(changes)
    return inputs


def _rows_off(name):
    base = make_chain([2, 3], 6, seed=23)[name].clone()
    base[1, 2] += 0.5
    return base


def _with(name, index, value):
    base = make_chain([2, 3], 6, seed=23)[name].clone()
    base[index] = value
    return base


BAD_CHAIN = {
    "target_probs": [
        dict(target_probs=torch.zeros(7)),  # not 2-D
        dict(target_probs=torch.zeros(7, 6, dtype=torch.long)),  # dtype
        dict(target_probs=torch.full((6, 6), 1 / 6)),  # rows != Σ(ℓ+1)
        dict(target_probs=_with("target_probs", (1, 2), float("nan"))),
        dict(target_probs=_with("target_probs", (1, 2), float("inf"))),
        dict(target_probs=_rows_off("target_probs")),
    ],
    "draft_probs": [
        dict(draft_probs=torch.full((4, 6), 1 / 6)),  # Σℓ rows expected
        dict(draft_probs=torch.full((5, 7), 1 / 7)),  # vocabulary mismatch
        dict(draft_probs=_rows_off("draft_probs")),
        dict(draft_probs=_with("draft_probs", (0, 0), -0.1)),
    ],
    "draft_tokens": [
        dict(draft_tokens=torch.zeros(5)),  # float dtype
        dict(draft_tokens=torch.zeros(4, dtype=torch.long), draft_probs=None, uniforms=None),  # Σℓ mismatch
        dict(draft_tokens=torch.tensor([0, 1, 6, 2, 3])),  # out of range
        dict(draft_tokens=torch.tensor([0, -1, 2, 2, 3])),
        dict(draft_tokens=torch.zeros(5, dtype=torch.long, device="meta")),  # device mismatch
    ],
    "num_draft": [
        dict(num_draft=torch.tensor([6, -1])),  # negative length
        dict(num_draft=torch.tensor([2.0, 3.0])),
        dict(num_draft=torch.tensor([[2, 3]])),
    ],
    "uniforms": [
        dict(uniforms=torch.zeros(5, dtype=torch.float64)),  # a coin of exactly 0
        dict(uniforms=torch.ones(5, dtype=torch.float64)),
        dict(uniforms=torch.full((4,), 0.5, dtype=torch.float64)),
    ],
    "noise": [
        dict(noise=torch.zeros(2, 6)),
        dict(noise=torch.full((2, 6), float("inf"))),
        dict(noise=torch.ones(3, 6)),
    ],
    "seeds": [dict(seeds=torch.tensor([1, 2]))],
    "offsets": [dict(seeds=torch.tensor([1, 2]), offsets=torch.tensor([1.0, 2.0]))],
    "backend": [dict(backend="cuda")],
}


BAD_CHAIN_CASES = [(name, changes) for name, cases in BAD_CHAIN.items() for changes in cases]


@pytest.mark.parametrize("name,changes", BAD_CHAIN_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CHAIN_CASES)])
def test_chain_bad_input_names_argument(name, changes):
    changes = dict(changes)
    backend = changes.pop("backend", "torch")
    with pytest.raises(ValueError, match=f"^{name}"):
        verify_chain(**_bad(**changes), backend=backend)


@pytest.mark.parametrize(
    "name,args",
    [
        ("target_logits", (torch.zeros(5, 4), torch.tensor([1, 2]), torch.tensor([2]))),  # rows
        ("target_logits", (torch.full((3, 4), float("nan")), torch.tensor([1, 2]), torch.tensor([2]))),
        ("target_logits", (torch.zeros(3, 4, dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([2]))),
        ("draft_tokens", (torch.zeros(3, 4), torch.tensor([1, 4]), torch.tensor([2]))),
        ("draft_tokens", (torch.zeros(3, 4), torch.tensor([1]), torch.tensor([2]))),
        ("num_draft", (torch.zeros(3, 4), torch.tensor([1, 2]), torch.tensor([3, -1]))),
    ],
)
def test_greedy_bad_input_names_argument(name, args):
    with pytest.raises(ValueError, match=f"^{name}"):
        verify_greedy(*args)


def test_validate_false_skips_value_checks():
    inputs = _bad(draft_probs=_rows_off("draft_probs"))
    verify_chain(**inputs, validate=False)  # no ValueError
