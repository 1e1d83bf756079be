"""Triton kernels against the torch reference, on CPU in the Triton interpreter.

``DSPEC_TEST_DEVICE=cuda`` runs the same cases compiled on a GPU instead (docs/benchmarks.md).
Triton reads TRITON_INTERPRET when `triton.jit` wraps a function, not at `import triton`;
dspec_cli.runtime.verify.triton wraps its kernels lazily, once per setting, so setting the variable
per test (monkeypatch) is enough and nothing leaks into other test modules.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from dspec_cli.core.sampling import torch_exponential, torch_uniform  # noqa: E402
from dspec_cli.runtime.verify import block as block_reference  # noqa: E402
from dspec_cli.runtime.verify import reference, verify_chain, verify_greedy  # noqa: E402
from dspec_cli.runtime.verify import triton as triton_backend  # noqa: E402
from dspec_cli.runtime.verify import triton_block  # noqa: E402

DEVICE = torch.device(os.environ.get("DSPEC_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_inputs(R, V, gamma, seed, *, closeness=0.5, dtype=torch.float32):
    """Ragged lengths in [0, γ], drafts sampled from q close to p, explicit randomness."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, gamma + 1, (R,), generator=g)
    total, width = int(num_draft.sum()), int(num_draft.max())
    logits = torch.randn(total + R, V, generator=g) * 4  # peaked, so drafts are often accepted
    is_draft_row = torch.ones(total + R, dtype=torch.bool)
    is_draft_row[num_draft.cumsum(0) + torch.arange(R)] = False  # bonus rows
    draft_probs = torch.softmax(logits[is_draft_row] + closeness * torch.randn(total, V, generator=g), -1)
    draft_tokens = torch.multinomial(draft_probs, 1, generator=g).squeeze(1) if total else torch.zeros(0, dtype=torch.long)
    x = dict(
        target_probs=torch.softmax(logits, -1).to(dtype),
        target_logits=logits.to(dtype),
        draft_tokens=draft_tokens,
        draft_probs=draft_probs.to(dtype),
        num_draft=num_draft,
        uniforms=torch_uniform((total,), generator=g),
        noise=torch_exponential((R, V), generator=g),
    )
    return {**{k: v.to(DEVICE) for k, v in x.items()}, "total": total, "width": width}


BOTH = ("torch", "triton")


def chain_args(x, drafts=None, q="draft"):
    """Positional arguments of reference.chain / triton_backend.chain."""
    q = x["draft_probs"] if q == "draft" else q
    drafts = x["draft_tokens"] if drafts is None else drafts
    return (x["target_probs"], drafts, q, x["num_draft"], x["uniforms"], x["noise"], x["total"], x["width"])


def assert_same(a, b):
    assert torch.equal(a.accepted, b.accepted), (a.accepted, b.accepted)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.num_tokens, b.num_tokens)


CASES = [  # (R, V, γ, BLOCK_V); None = the default block
    (1, 7, 1, None),
    (1, 1000, 16, 128),
    (4, 1000, 4, None),
    (16, 257, 7, 64),
    (16, 96, 16, 32),
    (9, 512, 3, 512),
]


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("R,V,gamma,block", CASES)
def test_chain_kernel_matches_reference(R, V, gamma, block, one_hot):
    x = make_inputs(R, V, gamma, seed=R * 1000 + V + gamma)
    if one_hot:  # a greedy drafter
        args = chain_args(x, drafts=x["draft_probs"].argmax(-1), q=None)
    else:
        args = chain_args(x)
    ref = reference.chain(*args)
    assert_same(triton_backend.chain(*args, block_v=block), ref)


@pytest.mark.parametrize("R,V,gamma,block", CASES)
def test_greedy_kernel_matches_reference(R, V, gamma, block):
    x = make_inputs(R, V, gamma, seed=R + V + gamma)
    # let drafts follow the argmax most of the time so acceptance runs are long
    best = x["target_logits"].argmax(-1)
    is_draft_row = torch.ones(best.numel(), dtype=torch.bool, device=DEVICE)
    is_draft_row[x["num_draft"].cumsum(0) + torch.arange(R, device=DEVICE)] = False
    follow = (torch.rand(x["total"], generator=torch.Generator().manual_seed(R)) < 0.8).to(DEVICE)
    drafts = torch.where(follow, best[is_draft_row], x["draft_tokens"])
    args = (x["target_logits"], drafts, x["num_draft"], x["total"], x["width"])
    assert_same(triton_backend.greedy(*args, block_v=block), reference.greedy(*args))


@pytest.mark.parametrize("closeness", [0.3, 1.0])
@pytest.mark.parametrize("R,V,gamma,block", CASES)
def test_block_kernels_match_reference(R, V, gamma, block, closeness):
    x = make_inputs(R, V, gamma, seed=R * 100 + V + gamma, closeness=closeness)
    args = chain_args(x)
    assert_same(triton_block.block(*args, block_v=block), block_reference.block(*args))


def test_block_half_precision_and_counter_randomness():
    x = make_inputs(5, 200, 4, seed=9, dtype=torch.bfloat16, closeness=0.3)
    args = chain_args(x)
    assert_same(triton_block.block(*args, block_v=64), block_reference.block(*args))
    x = make_inputs(6, 64, 5, seed=10, closeness=0.3)
    kw = dict(seeds=torch.arange(6, device=DEVICE) + 40, offsets=torch.arange(6, device=DEVICE) * 9, method="block")
    out = [verify_chain(x["target_probs"], x["draft_tokens"], x["draft_probs"], x["num_draft"], backend=b, **kw)
           for b in BOTH]
    assert_same(*out)


def test_public_api_backends_agree():
    x = make_inputs(12, 300, 7, seed=5)
    kw = dict(uniforms=x["uniforms"], noise=x["noise"])
    for q in (x["draft_probs"], None):
        chain = [verify_chain(x["target_probs"], x["draft_tokens"], q, x["num_draft"], backend=b, **kw) for b in BOTH]
        assert_same(*chain)
    greedy = [verify_greedy(x["target_logits"], x["draft_tokens"], x["num_draft"], backend=b) for b in BOTH]
    assert_same(*greedy)


def test_counter_randomness_agrees_across_backends():
    x = make_inputs(6, 64, 5, seed=6)
    kw = dict(seeds=torch.arange(6, device=DEVICE) + 40, offsets=torch.arange(6, device=DEVICE) * 9)
    args = (x["target_probs"], x["draft_tokens"], x["draft_probs"], x["num_draft"])
    out = [verify_chain(*args, backend=b, **kw) for b in BOTH]
    assert_same(*out)


def test_half_precision_inputs():
    x = make_inputs(5, 200, 4, seed=7, dtype=torch.bfloat16)
    args = chain_args(x)
    assert_same(triton_backend.chain(*args, block_v=64), reference.chain(*args))
    g_args = (x["target_logits"], x["draft_tokens"], x["num_draft"], x["total"], x["width"])
    assert_same(triton_backend.greedy(*g_args, block_v=64), reference.greedy(*g_args))


def test_all_zero_drafts_and_empty_batch():
    x = make_inputs(3, 50, 0, seed=8)
    args = chain_args(x)
    assert_same(triton_backend.chain(*args), reference.chain(*args))
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    empty = triton_backend.chain(torch.zeros(0, 5, device=DEVICE), none, None, none,
                                 torch.zeros(0, dtype=torch.float64, device=DEVICE), torch.ones(0, 5, device=DEVICE), 0, 0)
    assert empty.tokens.shape == (0, 1)
