"""The padded (``*_grid``) verifiers on the Triton backend: the same accept decisions, tokens and
padding as the torch grid path, bit for bit (token and block rules, one-hot drafts, greedy,
explicit and counter noise, rows verifying 0..W drafts), no host reads, and lossless by
chi-square. CPU tensors run the kernels in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); ``DSPEC_TEST_DEVICE=cuda`` runs them compiled."""

import os

import pytest
import torch

pytest.importorskip("triton")

from dspec_cli import testing as T  # noqa: E402
from dspec_cli.core.host import device_path  # noqa: E402
from dspec_cli.core.sampling import CounterNoise, torch_uniform  # noqa: E402
from dspec_cli.core.types import PAD, VerifyResult  # noqa: E402
from dspec_cli.runtime.verify import (  # noqa: E402
    _backend,
    reference,
    triton_block,
    verify_chain_grid,
    verify_chain_logits_grid,
    verify_greedy_grid,
)
from dspec_cli.runtime.verify import block as block_reference  # noqa: E402
from dspec_cli.runtime.verify import triton as triton_backend  # noqa: E402
from dspec_cli.testing.host_reads import count_host_reads  # noqa: E402

DEVICE = torch.device(os.environ.get("DSPEC_TEST_DEVICE", "cpu"))

CASES = [  # (R, W, V): V = 2500 splits into several vocabulary blocks, none a multiple of the block
    (1, 1, 7),
    (5, 4, 37),
    (8, 7, 300),
    (3, 3, 2500),
    (4, 0, 20),
]


def make_grid(R: int, W: int, V: int, seed: int):
    """Padded rows whose padding holds valid-looking junk (tokens, probabilities, coins) the
    verifiers must ignore; ℓ covers 0..W; some drafts are the target's favourite."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(R, W + 1, V, generator=g) * 4, -1)  # peaked: drafts are often accepted
    q = torch.softmax(torch.log(p[:, :W] + 1e-3) + torch.randn(R, W, V, generator=g), -1)  # close to p
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(R, W) if W else torch.zeros(R, 0, dtype=torch.long)
    follow = torch.rand(R, W, generator=g) < 0.5
    drafts = torch.where(follow, p[:, :W].argmax(-1), drafts)
    ell = (torch.randperm(R, generator=g) + 1) % (W + 1)
    x = dict(p=p, q=q, drafts=drafts, ell=ell, u=torch_uniform((R, W), generator=g),
             noise=-torch.rand(R, V, generator=g).clamp_min(1e-9).log(),
             seeds=torch.randint(0, 2**40, (R,), generator=g), offsets=torch.randint(0, 2**20, (R,), generator=g))
    return {k: v.to(DEVICE) for k, v in x.items()}


def both(fn, *args, **kw) -> VerifyResult:
    """fn on the torch and Triton backends, asserted identical (padding included); the Triton one."""
    want, got = fn(*args, backend="torch", **kw), fn(*args, backend="triton", **kw)
    assert got.tokens.shape == want.tokens.shape
    assert torch.equal(got.accepted, want.accepted), (got.accepted, want.accepted)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    assert torch.equal(got.num_tokens, want.num_tokens)
    return got


@pytest.mark.parametrize("counter", [False, True])
@pytest.mark.parametrize("R,W,V", CASES)
def test_chain_grid_triton_equals_torch(R, W, V, counter):
    x = make_grid(R, W, V, seed=R * 100 + W * 10 + V)
    noise = CounterNoise(x["seeds"], x["offsets"], 5) if counter else x["noise"]
    accepted = 0
    for method in ("token", "block"):
        for q in (x["q"], None):
            res = both(verify_chain_grid, x["p"], x["drafts"], q, x["ell"], method=method, uniforms=x["u"], noise=noise)
            past = torch.arange(W + 1, device=DEVICE) >= res.num_tokens[:, None]  # [R, W+1]
            assert (res.tokens[past] == PAD).all()
            accepted += int(res.accepted.sum())
    assert R * W < 8 or 0 < accepted < 4 * int(x["ell"].sum())  # accepts and rejects both happen


@pytest.mark.parametrize("R,W,V", CASES[1:4])
def test_chain_grid_from_logits_triton_equals_torch(R, W, V):
    """The engine's CUDA verify: the kernels read the logits (fp32 or bf16, no probabilities
    written), token and block rules, one-hot drafts, explicit and counter noise; the torch path
    computes logits_to_probs first. Same decisions and tokens."""
    x = make_grid(R, W, V, seed=R * 7 + W + V)
    logits = torch.log(x["p"]) * 1.3  # softmax(logits / 1.3) = p
    for dtype, noise in ((torch.float32, x["noise"]), (torch.bfloat16, CounterNoise(x["seeds"], x["offsets"], 5))):
        for method in ("token", "block"):
            for q in (x["q"], None):
                both(verify_chain_logits_grid, logits.to(dtype), x["drafts"], q, x["ell"], temperature=1.3,
                     method=method, uniforms=x["u"], noise=noise)


@pytest.mark.parametrize("R,W,V", CASES)
def test_greedy_grid_triton_equals_torch(R, W, V):
    x = make_grid(R, W, V, seed=R + W + V)
    res = both(verify_greedy_grid, x["p"].log(), x["drafts"], x["ell"])
    assert R * W < 8 or 0 < int(res.accepted.sum()) < int(x["ell"].sum())  # accepts and rejects both happen


@pytest.mark.parametrize("block_v", [16, 64])
def test_kernels_split_the_vocabulary_in_grid_layout(block_v):
    """The kernels called directly in the padded layout (cu = arange(R)·W + ℓ), with blocks that
    split V = 150 unevenly: the torch grid references' results."""
    R, W, V = 6, 5, 150
    x = make_grid(R, W, V, seed=block_v)
    flat = (x["p"].flatten(0, 1), x["drafts"].flatten(), x["q"].flatten(0, 1), x["ell"], x["u"].flatten(),
            x["noise"], R * W, W)  # fmt: skip
    cu = triton_backend.grid_ends(x["ell"], W)
    for q in (flat[2], None):
        args = (*flat[:2], q, *flat[3:])
        want = reference.chain(*args, grid=True)
        got = triton_backend.chain(*args, cu=cu, block_v=block_v)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.accepted, want.accepted)
    g_args = (x["p"].log().flatten(0, 1), flat[1], x["ell"], R * W, W)
    want = reference.greedy(*g_args, grid=True)
    assert torch.equal(triton_backend.greedy(*g_args, cu=cu, block_v=block_v).tokens, want.tokens)
    want = block_reference.block(*flat, grid=True)
    got = triton_block.block(*flat, cu=cu, block_v=block_v)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.accepted, want.accepted)


def test_final_uniforms_take_the_torch_path():
    x = make_grid(4, 3, 20, seed=1)
    args = (x["p"], x["drafts"], x["q"], x["ell"])
    fu = torch_uniform((4,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with pytest.raises(ValueError, match="final_uniforms"):
        verify_chain_grid(*args, uniforms=x["u"], final_uniforms=fu, backend="triton")
    auto = verify_chain_grid(*args, uniforms=x["u"], final_uniforms=fu)  # "auto": the reference, silently
    want = verify_chain_grid(*args, uniforms=x["u"], final_uniforms=fu, backend="torch")
    assert torch.equal(auto.tokens, want.tokens)


def test_auto_is_torch_on_cpu_and_triton_on_cuda():
    assert _backend("auto", torch.device("cpu")) is reference
    assert _backend("auto", torch.device("cuda")) is triton_backend


def test_grid_calls_never_read_back():
    """Warm (per-device constants made), a Triton grid call makes no host read and no
    host-to-device copy: a CUDA graph can capture it. (Under the interpreter this counts the
    wrappers' torch work; the launches themselves never touch a tensor's values on the host.)"""
    R, W, V = 4, 3, 40
    x = make_grid(R, W, V, seed=3)
    noise = CounterNoise(x["seeds"], x["offsets"], 5)
    calls = [
        lambda m, q: verify_chain_grid(x["p"], x["drafts"], q, x["ell"], method=m, uniforms=x["u"], noise=noise,
                                       backend="triton"),
        lambda m, q: verify_chain_grid(x["p"], x["drafts"], q, x["ell"], method=m, uniforms=x["u"], noise=x["noise"],
                                       backend="triton"),
        lambda m, q: verify_greedy_grid(x["p"].log(), x["drafts"], x["ell"], backend="triton"),
        lambda m, q: verify_chain_logits_grid(x["p"].log(), x["drafts"], q, x["ell"], temperature=0.9, method=m,
                                              uniforms=x["u"], noise=noise, backend="triton"),
    ]  # fmt: skip
    for call in calls:
        for method in ("token", "block"):
            for q in (x["q"], None):
                with device_path():
                    call(method, q)  # warm
                with count_host_reads() as reads:
                    call(method, q)
                assert reads.total == 0, reads.sites.most_common(5)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="runs a CPU engine on the interpreted kernels")
def test_engine_rounds_on_the_triton_kernels_give_the_torch_race_tokens(monkeypatch):
    """A CUDA round's acceptance, on a CPU: the engine's race path (final tokens by counter
    noise, logits in the model's dtype, as on CUDA) with the grid verifiers' "auto" backend on
    the (interpreted) Triton kernels, which read the logits, gives the tokens of the same path on
    the torch reference: plain steps and dspark's chains (block and token rules, T = 0, 0.7, 1),
    continuous batching of 3 rows."""
    from dspec_cli.core.plugins import get_drafter_class
    from dspec_cli.runtime import verify as verify_module
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
    from tests.tiny_models import tiny_target

    target = tiny_target("qwen3", seed=0)
    cls = get_drafter_class("dspark-markov")
    torch.manual_seed(1)
    dspark = cls.build(cls.config_class(block_size=4, num_layers=2, markov_rank=16), target)
    prompts = [[5, 17, 33, 2, 90, 41], [7, 8, 9], [100, 3, 64, 64, 12, 1, 5, 77, 2], [4, 4]]
    real = verify_module._backend
    called: set[str] = set()

    def spy(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: called.add(name) or fn(*a, **k))

    spy(triton_backend, "chain_logits"), spy(triton_block, "block_logits"), spy(triton_backend, "draw")

    def run(kernels: bool, drafter, **settings):
        engine = SpeculativeEngine(target, drafter, GenerationConfig(max_new_tokens=8, block_size=4, max_batch=3, seed=3,
                                                                     **settings), stop_ids=[])
        engine._inverse_cdf = False  # the race, as off a CPU
        with monkeypatch.context() as patch, device_path():
            if kernels:
                patch.setattr(verify_module, "_backend", lambda b, d: real("triton" if b == "auto" else b, d))
            return [r.output_ids for r in engine.generate(prompts)], engine.stats.verify_rules

    for drafter, settings in ((None, dict(temperature=1.0)), (dspark, dict(temperature=1.0)),
                              (dspark, dict(temperature=0.7, chain_verify="token")), (dspark, dict(temperature=0.0))):
        want, rules = run(False, drafter, **settings)
        assert run(True, drafter, **settings) == (want, rules), settings
    assert called == {"chain_logits", "block_logits", "draw"}


# -- lossless on the Triton grid path: chi-square against exact target sampling ---------------
# 100 requests (the interpreter runs each program in Python, a few seconds a test): coins bent
# to u³ are rejected at p < 1e-6 while the real path passes at alpha = 1e-4 (p ≈ 0.8 for both rules).

GAMMA = 3
PAIR = (torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.1, 0.3, 0.6]))  # target and a drafter that mostly disagrees


def _grid_verifier(target_probs, draft_tokens, draft_probs, num_draft, *, generator, method, bend=None, logits=False):
    """The ragged round of simulate_speculative laid out as padded rows of GAMMA drafts (junk in
    the padding) and verified by verify_chain_grid on the Triton backend (``logits``: by
    verify_chain_logits_grid on log-probabilities at T = 1, what the engine runs on CUDA);
    ``bend`` maps the coins (a deliberately wrong draw)."""
    R, V = num_draft.numel(), target_probs.shape[1]
    rows = torch.arange(GAMMA + 1) <= num_draft[:, None]  # [R, GAMMA+1]
    p = torch.softmax(torch.randn(R, GAMMA + 1, V, generator=generator), -1)
    p[rows] = target_probs
    drafts = torch.randint(V, (R, GAMMA), generator=generator)
    drafts[rows[:, 1:]] = draft_tokens
    q = torch.softmax(torch.randn(R, GAMMA, V, generator=generator), -1)
    q[rows[:, 1:]] = draft_probs
    u = torch_uniform((R, GAMMA), generator=generator)
    noise = CounterNoise(torch.randint(0, 2**62, (R,), generator=generator).to(DEVICE), torch.zeros(R, dtype=torch.long,
                         device=DEVICE), 7)  # fmt: skip
    args = (drafts.to(DEVICE), q.to(DEVICE), num_draft.to(DEVICE))
    kw = dict(method=method, uniforms=(u if bend is None else bend(u)).to(DEVICE), noise=noise, backend="triton")
    if logits:
        res = verify_chain_logits_grid(p.log().to(DEVICE), *args, temperature=1.0, **kw)
    else:
        res = verify_chain_grid(p.to(DEVICE), *args, **kw)
    return VerifyResult(res.accepted.cpu(), res.tokens.cpu(), res.num_tokens.cpu())


def _p_value(method: str, **verifier_kw) -> float:
    target = T.ToyLM.from_probs(PAIR[0])
    drafter = T.ToyDrafter(T.ToyLM.from_probs(PAIR[1]))
    gen = torch.Generator().manual_seed(4)
    tokens = T.simulate_speculative(
        target, drafter, num_requests=100, gamma=GAMMA, num_tokens=2, generator=gen,
        length_policy=T.random_length_policy(torch.Generator().manual_seed(5)),
        verifier=lambda *a, **k: _grid_verifier(*a, **k, method=method, **verifier_kw),
    )  # fmt: skip
    return T.gof_test(tokens, T.exact_target_joint(target, 0, 2)).p_value  # the first two tokens


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_grid_path_is_lossless(method, logits):
    assert _p_value(method, logits=logits) > 1e-4


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_grid_path_with_bent_coins_is_caught(method, logits):
    assert _p_value(method, bend=lambda u: u**3, logits=logits) < 1e-6  # coins too small: drafts accepted too often
