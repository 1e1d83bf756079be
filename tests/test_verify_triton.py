"""Triton kernels against the torch reference, on CPU in the Triton interpreter.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton (Triton binds its language
to the interpreter at import). ``DSPEC_TEST_DEVICE=cuda`` runs the same cases compiled on a GPU
instead (docs/benchmarks.md). Vocabularies stay small (the interpreter runs every program in
Python); explicit ``block_v`` values split them into several blocks, V not a multiple of the
block included.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dspec_cli import testing as T  # noqa: E402
from dspec_cli.core.sampling import (  # noqa: E402
    CounterNoise,
    logits_to_probs,
    sample_from_probs,
    torch_exponential,
    torch_uniform,
)
from dspec_cli.core.types import VerifyResult  # noqa: E402
from dspec_cli.runtime.verify import block as block_reference  # noqa: E402
from dspec_cli.runtime.verify import (  # noqa: E402
    reference,
    sample_logits,
    triton_block,  # noqa: E402
    verify_chain,
    verify_chain_logits,
    verify_greedy,
)
from dspec_cli.runtime.verify import triton as triton_backend  # noqa: E402

DEVICE = torch.device(os.environ.get("DSPEC_TEST_DEVICE", "cpu"))
BOTH = ("torch", "triton")


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
        seeds=torch.randint(0, 2**40, (R,), generator=g),
        offsets=torch.randint(0, 2**20, (R,), generator=g),
    )
    return {**{k: v.to(DEVICE) for k, v in x.items()}, "total": total, "width": width}


def chain_args(x, drafts=None, q="draft", noise=None):
    """Positional arguments of reference.chain / triton_backend.chain."""
    q = x["draft_probs"] if q == "draft" else q
    drafts = x["draft_tokens"] if drafts is None else drafts
    noise = x["noise"] if noise is None else noise
    return (x["target_probs"], drafts, q, x["num_draft"], x["uniforms"], noise, x["total"], x["width"])


def counter_noise(x) -> CounterNoise:
    return CounterNoise(x["seeds"], x["offsets"], 2)


def assert_same(a, b):
    assert torch.equal(a.accepted, b.accepted), (a.accepted, b.accepted)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.num_tokens, b.num_tokens)


CASES = [  # (R, V, γ, BLOCK_V); None = the default block
    (1, 7, 1, None),
    (1, 1000, 16, 128),
    (4, 1000, 4, None),
    (16, 257, 7, 64),
    (9, 96, 16, 32),
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
    assert one_hot or R == 1 or 0 < ref.accepted.sum() < x["total"]  # accepts and rejects both happen
    assert_same(triton_backend.chain(*args, block_v=block), ref)


@pytest.mark.parametrize("R,V,gamma,block", CASES[1:4])
def test_counter_noise_in_the_kernel_is_the_reference_noise(R, V, gamma, block):
    x = make_inputs(R, V, gamma, seed=R + 3 * V + gamma)
    noise = counter_noise(x)
    ref = reference.chain(*chain_args(x, noise=noise.tensor(V)))
    assert_same(triton_backend.chain(*chain_args(x, noise=noise), block_v=block), ref)
    # flat logits: the draw is the argmin of the noise itself
    flat = torch.zeros(R, V, device=DEVICE)
    tokens = triton_backend.draw(flat, 1.0, noise, block_v=block)
    assert torch.equal(tokens, noise.tensor(V).argmin(-1))


@pytest.mark.parametrize(  # every case once, each (temperature, drafts) pair on a few of them
    "R,V,gamma,block,temperature,one_hot",
    [(*case, (1.0, 0.7)[i % 2], i % 4 >= 2) for i, case in enumerate(CASES)],
)
def test_chain_from_logits_matches_reference_on_probs(R, V, gamma, block, temperature, one_hot):
    x = make_inputs(R, V, gamma, seed=R * 7 + V + gamma)
    drafts, q = (x["draft_probs"].argmax(-1), None) if one_hot else (x["draft_tokens"], x["draft_probs"])
    rest = (drafts, q, x["num_draft"], x["uniforms"], counter_noise(x), x["total"], x["width"])
    ref = reference.chain(logits_to_probs(x["target_logits"], temperature), *rest)
    assert_same(triton_backend.chain_logits(x["target_logits"], temperature, *rest, block_v=block), ref)


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


def test_greedy_ties_take_the_first_index_across_blocks():
    logits = torch.zeros(3, 100, device=DEVICE)
    logits[0, [40, 70, 99]] = 5.0  # ties in different blocks of 32
    logits[1, [33, 34]] = 5.0  # ties in one block
    logits[2] = -float("inf")  # no finite entry: index 0, as torch.argmax
    none = torch.zeros(3, dtype=torch.long, device=DEVICE)
    result = triton_backend.greedy(logits, none[:0], none, 0, 0, block_v=32)
    assert result.tokens[:, 0].tolist() == [40, 33, 0] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("N,V,block", [(1, 7, None), (12, 1000, 128), (5, 300, None)])
def test_draw_matches_reference(N, V, block, temperature):
    g = torch.Generator().manual_seed(N + V)
    logits = (torch.randn(N, V, generator=g) * 2).to(DEVICE)
    noise = CounterNoise(torch.arange(N, device=DEVICE) + 9, torch.arange(N, device=DEVICE) * 5, 11)
    if temperature == 0:
        want, got = logits.argmax(-1), triton_backend.draw(logits, 0.0, None, block_v=block)
    else:
        want = sample_from_probs(logits_to_probs(logits, temperature), noise.tensor(V))
        got = triton_backend.draw(logits, temperature, noise, block_v=block)
    assert torch.equal(got, want)


def test_strided_and_half_precision_rows():
    x = make_inputs(5, 200, 4, seed=7, dtype=torch.bfloat16)
    args = chain_args(x)
    assert_same(triton_backend.chain(*args, block_v=64), reference.chain(*args))
    g_args = (x["target_logits"], x["draft_tokens"], x["num_draft"], x["total"], x["width"])
    assert_same(triton_backend.greedy(*g_args, block_v=64), reference.greedy(*g_args))
    wide = torch.randn(4, 3, 150, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = wide[:, 1]  # [4, 150] with row stride 450: read in place
    noise = CounterNoise(torch.arange(4, device=DEVICE), torch.arange(4, device=DEVICE), 3)
    want = sample_from_probs(logits_to_probs(rows, 0.9), noise.tensor(150))
    assert torch.equal(triton_backend.draw(rows, 0.9, noise, block_v=64), want)


def test_all_zero_drafts_and_empty_batch():
    x = make_inputs(3, 50, 0, seed=8)
    args = chain_args(x)
    assert_same(triton_backend.chain(*args), reference.chain(*args))
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    empty = triton_backend.chain(torch.zeros(0, 5, device=DEVICE), none, None, none,
                                 torch.zeros(0, dtype=torch.float64, device=DEVICE), torch.ones(0, 5, device=DEVICE), 0, 0)
    assert empty.tokens.shape == (0, 1)
    assert triton_backend.draw(torch.zeros(0, 5, device=DEVICE), 1.0, None).shape == (0,)


@pytest.mark.parametrize("closeness", [0.3, 1.0])
@pytest.mark.parametrize("R,V,gamma,block", CASES)
def test_block_kernels_match_reference(R, V, gamma, block, closeness):
    x = make_inputs(R, V, gamma, seed=R * 100 + V + gamma, closeness=closeness)
    args = chain_args(x)
    assert_same(triton_block.block(*args, block_v=block), block_reference.block(*args))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("R,V,gamma,block", CASES[1:5])
def test_block_from_logits_matches_reference_on_probs(R, V, gamma, block, temperature):
    """The block kernels reading logits (probabilities computed where they are read, counter
    noise in the kernel) decide and draw as the reference on logits_to_probs."""
    x = make_inputs(R, V, gamma, seed=R * 11 + V + gamma, closeness=0.3)
    rest = (x["draft_tokens"], x["draft_probs"], x["num_draft"], x["uniforms"], counter_noise(x), x["total"], x["width"])
    ref = block_reference.block(logits_to_probs(x["target_logits"], temperature), *rest)
    assert ref.accepted.sum() > 0
    assert_same(triton_block.block_logits(x["target_logits"], temperature, *rest, block_v=block), ref)
    half = triton_block.block_logits(x["target_logits"].bfloat16(), temperature, *rest, block_v=block)
    assert_same(half, block_reference.block(logits_to_probs(x["target_logits"].bfloat16(), temperature), *rest))


def test_block_half_precision_and_counter_randomness():
    x = make_inputs(5, 200, 4, seed=9, dtype=torch.bfloat16, closeness=0.3)
    args = chain_args(x)
    assert_same(triton_block.block(*args, block_v=64), block_reference.block(*args))
    x = make_inputs(6, 64, 5, seed=10, closeness=0.3)
    kw = dict(seeds=torch.arange(6, device=DEVICE) + 40, offsets=torch.arange(6, device=DEVICE) * 9, method="block")
    out = [verify_chain(x["target_probs"], x["draft_tokens"], x["draft_probs"], x["num_draft"], backend=b, **kw)
           for b in BOTH]
    assert_same(*out)


# -- the public API on both backends --------------------------------------------------------


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


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0),
            dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.8)]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS + [dict(temperature=0.8, method="block")])
def test_logits_api_backends_agree(settings):
    x = make_inputs(10, 400, 6, seed=9, closeness=0.2)
    keys = dict(seeds=x["seeds"], offsets=x["offsets"])
    args = (x["target_logits"], x["draft_tokens"], x["draft_probs"], x["num_draft"])
    ref = verify_chain_logits(*args, backend="torch", **keys, **settings)
    assert 0 < ref.accepted.sum() < x["total"]
    assert_same(verify_chain_logits(*args, backend="triton", **keys, **settings), ref)
    quiet = verify_chain_logits(*args, backend="triton", max_draft=x["width"], validate=False, **keys, **settings)
    assert_same(quiet, ref)
    logits = x["target_logits"][:7]
    settings = {k: v for k, v in settings.items() if k != "method"}
    draws = [sample_logits(logits, x["seeds"][:7], x["offsets"][:7], salt=5, backend=b, **settings) for b in BOTH]
    assert torch.equal(*draws)


def test_logits_api_bad_settings_name_the_argument():
    x = make_inputs(3, 40, 2, seed=10)
    args = (x["target_logits"], x["draft_tokens"], None, x["num_draft"])
    with pytest.raises(ValueError, match="temperature"):
        verify_chain_logits(*args, temperature=-1.0, backend="triton")
    with pytest.raises(ValueError, match="max_draft: must equal max"):
        verify_chain_logits(*args, max_draft=x["width"] + 1, backend="triton")
    with pytest.raises(ValueError, match="temperature"):
        sample_logits(x["target_logits"][:3], x["seeds"], x["offsets"], salt=1, temperature=float("inf"), backend="triton")


def test_call_paths_never_read_back(monkeypatch):
    """The Triton calls (and the logits-level API given max_draft, validate=False) make no host
    read: a CUDA graph can capture them."""
    x = make_inputs(6, 120, 4, seed=11)
    rows = x["target_logits"].shape[0]
    seeds, offsets = x["seeds"].repeat(rows)[:rows], x["offsets"].repeat(rows)[:rows]

    def no_read(*_args, **_kw):
        raise AssertionError("host read in a Triton call path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, no_read)
    noise = counter_noise(x)
    triton_backend.chain(*chain_args(x, noise=noise))
    triton_backend.chain_logits(x["target_logits"], 0.8, *chain_args(x, noise=noise)[1:])
    triton_backend.greedy(x["target_logits"], x["draft_tokens"], x["num_draft"], x["total"], x["width"])
    triton_backend.draw(x["target_logits"], 1.0, noise)
    kw = dict(seeds=x["seeds"], offsets=x["offsets"], max_draft=x["width"], validate=False, backend="triton")
    args = (x["target_logits"], x["draft_tokens"], x["draft_probs"], x["num_draft"])
    verify_chain_logits(*args, temperature=0.9, uniforms=x["uniforms"], **kw)
    verify_chain_logits(*args, temperature=0.0, **kw)
    sample_logits(x["target_logits"], seeds, offsets, salt=4, temperature=0.9, backend="triton")


# -- lossless on the Triton path: chi-square against exact target sampling ---------------------
# The interpreter runs a few milliseconds per request, so these use a few hundred requests: a
# deliberately bent draw is still rejected at p < 1e-6 while the real path passes at alpha = 1e-4.

PAIR = (torch.tensor([0.9, 0.1]), torch.tensor([0.1, 0.9]))  # target and a drafter that mostly disagrees


def _triton_verifier(target_probs, draft_tokens, draft_probs, num_draft, *, generator, bend=None, logits_at=None):
    """verify_chain (or, given a temperature, verify_chain_logits on log p scaled to it) on the
    Triton backend with counter randomness; ``bend`` maps the coins (a deliberately wrong draw)."""
    R = num_draft.numel()
    seeds = torch.randint(0, 2**62, (R,), generator=generator)
    u = torch_uniform((draft_tokens.numel(),), generator=generator)
    u = u if bend is None else bend(u)
    q = None if draft_probs is None else draft_probs.to(DEVICE)
    args = (draft_tokens.to(DEVICE), q, num_draft.to(DEVICE))
    kw = dict(uniforms=u.to(DEVICE), seeds=seeds.to(DEVICE), offsets=torch.zeros_like(seeds).to(DEVICE), backend="triton")
    if logits_at is None:
        res = verify_chain(target_probs.to(DEVICE), *args, **kw)
    else:  # softmax(logits / T) is the target again
        res = verify_chain_logits((target_probs.log() * logits_at).to(DEVICE), *args, temperature=logits_at, **kw)
    return VerifyResult(res.accepted.cpu(), res.tokens.cpu(), res.num_tokens.cpu())


def _p_value(drafter_greedy: bool, **verifier_kw) -> float:
    target = T.ToyLM.from_probs(PAIR[0])
    drafter = T.ToyDrafter(T.ToyLM.from_probs(PAIR[1]), greedy=drafter_greedy)
    tokens = T.simulate_speculative(
        target, drafter, num_requests=200, gamma=1, num_tokens=2, generator=torch.Generator().manual_seed(3),
        verifier=lambda *a, **k: _triton_verifier(*a, **k, **verifier_kw),
    )  # fmt: skip
    return T.gof_test(tokens, T.exact_target_joint(target, 0, 2)).p_value  # the first two tokens


@pytest.mark.parametrize("drafter_greedy,logits_at", [(False, None), (True, 0.7)])
def test_triton_path_is_lossless(drafter_greedy, logits_at):
    assert _p_value(drafter_greedy, logits_at=logits_at) > 1e-4


def test_triton_path_with_bent_coins_is_caught():
    assert _p_value(False, bend=lambda u: u * u) < 1e-6  # coins too small: drafts accepted too often


# -- the compiled path (no GPU needed) -----------------------------------------------------------

COMPILE_CHECK = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dspec_cli.core.sampling import CounterNoise
from dspec_cli.runtime.verify import triton as tb
from dspec_cli.runtime.verify import triton_block as tbl

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32"}
built = []

def compile_only(kernel, grid, *args, block_v=None, **constants):
    constants.pop("num_warps", None)
    constants.pop("enable_fp_fusion", None)
    if block_v is not None:
        constants["BLOCK_V"] = block_v
    sig = {}
    for name, arg in zip(kernel.arg_names, args + (None,) * len(constants), strict=True):
        if name in constants:
            sig[name] = "constexpr"
        elif isinstance(arg, torch.Tensor):
            sig[name] = "*" + TYPES[arg.dtype]
        else:
            sig[name] = "fp32" if isinstance(arg, float) else "i64" if abs(arg) >= 2**31 else "i32"
    options = dict(num_warps=4 if block_v is None else max(4, min(16, block_v // 256)), enable_fp_fusion=False)
    triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", 90, 32), options=options)
    built.append(kernel.__name__)

class CompileOnly:  # kernel[grid](...) as triton_block launches them
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **constants: compile_only(self.kernel, grid, *args, **constants)

tb.check_device = tbl.check_device = lambda device: None
tb._run = compile_only
tbl._mass_kernel, tbl._decide_kernel = CompileOnly(tbl._mass_kernel), CompileOnly(tbl._decide_kernel)
R, V = 3, 5000
g = torch.Generator().manual_seed(0)
num = torch.tensor([2, 0, 3]); drafts = torch.randint(0, V, (5,), generator=g)
probs = torch.softmax(torch.randn(8, V, generator=g), -1); q = torch.softmax(torch.randn(5, V, generator=g), -1)
u = torch.rand(5, dtype=torch.float64, generator=g); noise = CounterNoise(torch.arange(R), torch.arange(R), 2)
tb.chain(probs, drafts, q, num, u, torch.ones(R, V), 5, 3)
tb.chain(probs, drafts, None, num, u, noise, 5, 3)
tb.chain_logits(probs.log().bfloat16(), 0.7, drafts, q, num, u, noise, 5, 3)
tb.greedy(probs.log(), drafts, num, 5, 3, cu=tb.grid_ends(num, 3))
tbl.block(probs, drafts, q, num, u, torch.ones(R, V), 5, 3)
tb.draw(probs.log().bfloat16(), 1.0, noise)
tb.draw(probs.log(), 0.0, None)
print(sorted(set(built)))
"""


def test_kernels_compile_for_cuda(tmp_path):
    """Every kernel the wrappers launch compiles for an sm_90 GPU (ptxas ships with triton): the
    interpreter does not run Triton's compiler, so this keeps the compiled path honest on CPUs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", COMPILE_CHECK], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == str(sorted([
        "_decide_kernel", "_mass_kernel", "block_argmax_kernel", "chain_accept_kernel", "greedy_decide_kernel",
        "race_decide_kernel", "race_partials_kernel", "row_stats_kernel",
    ]))  # fmt: skip
