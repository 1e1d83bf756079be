"""Schedulers: Algorithm 1 against a literal implementation, the async capacity rule,
non-anticipation (a property the retrospective search violates), chi-square losslessness
through the harness and the engine, the offline load simulation and ``dspec schedule``."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from tiny_models import assert_cli_error as _bad
from tiny_models import run_cli as run
from tiny_models import tiny_qwen3, tiny_target, tiny_tokenizer

from dspec_cli import testing as T
from dspec_cli.core import plugins
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.specs import parse_scheduler_spec
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.schedule import (
    AsyncScheduler,
    FixedScheduler,
    HardwareScheduler,
    ThresholdScheduler,
    admit,
    build_scheduler,
    column_sums,
    draft_throughput,
    global_capacity,
    sorted_candidates,
    survival,
    width_throughput,
)
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.calibrate import Rounds, save_traces
from dspec_cli.workflows.simulate import simulate_load

ALPHA = 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def table(sps: list[float], name: str = "cpu-test", model: str = "toy") -> CostTable:
    """A cost table with SPS(B) = sps[B-1] (one context)."""
    return CostTable(device="cpu", device_name=name, dtype="float32", model=model, torch=torch.__version__,
                     grid=list(range(1, len(sps) + 1)), contexts=[128], measured={"128": list(sps)})


# a jagged, decreasing curve: cliffs at 5, 9 and 17 tokens
JAGGED = table([1.0, 0.97, 0.95, 0.93, 0.7, 0.69, 0.68, 0.67, 0.5, 0.49, 0.48, 0.47, 0.46, 0.45, 0.44, 0.43, 0.3]
               + [0.3 * 16 / b for b in range(18, 65)])
APPENDIX = table([1.0, 0.5, 0.45])
# for R = 3 rows: the first extra token costs 30%, so Θ dips; whether it recovers later depends on all a_{r,j}
# for R = 4 rows: each extra token costs ~10%, so ℓ depends on the survival products
SMOOTH = table([1.0] * 4 + [1.0 / (1.0 + 0.1 * i) for i in range(1, 60)])
# for R = 4 rows verifying whole columns: the first column costs 50 %, so w = 1 pays when the mean a_1 > 1/2
COLUMNS = table([1.0] * 4 + [2 / 3] * 4 + [0.55] * 4 + [0.45] * 40)
COLUMNS_8 = table([1.0] * 8 + [0.75] * 8 + [0.6] * 8 + [0.5] * 40)  # R = 8: the first column pays when the mean a_1 > 1/3
DIP = table([1.0, 1.0, 1.0, 0.7] + [max(0.7 - 0.05 * i, 0.05) for i in range(1, 60)])


class RetrospectiveScheduler(HardwareScheduler):
    """Algorithm 1 without the early stop on the *current* confidences (Appendix A): NOT lossless."""

    name = "retrospective"

    def lengths(self, confidence, lmax):
        R, gamma = confidence.shape
        values, rows, num_valid = sorted_candidates(*survival(confidence, lmax))
        return admit(rows, global_capacity(values, num_valid, R, self._sps(R * (gamma + 1), confidence.device)), R)


class RetrospectiveColumns(HardwareScheduler):
    """The padded width by a global argmax over the *current* column sums (no early stop): NOT lossless."""

    name = "retrospective-columns"

    def lengths(self, confidence, lmax):
        R, gamma = confidence.shape
        theta = width_throughput(column_sums(*survival(confidence, lmax)), R, self._sps(R * (gamma + 1), confidence.device))
        return torch.minimum(lmax, theta.argmax())


def proposal(conf: torch.Tensor, lengths: torch.Tensor | None = None) -> Proposal:
    R, gamma = conf.shape
    lengths = torch.full((R,), gamma) if lengths is None else lengths
    return Proposal(tokens=torch.zeros(R, gamma, dtype=torch.long), lengths=lengths, confidence=conf)


def make(spec: str, cost: CostTable | None = None):
    """A scheduler from a ``NAME[,key=value]`` spec, as ``--scheduler`` builds it."""
    name, options = parse_scheduler_spec(spec)
    return build_scheduler(name, cost, **options)


def padded_widths(conf: torch.Tensor, lmax: torch.Tensor, sps: torch.Tensor) -> list[int]:
    """Algorithm 1 by columns, line by line: widen every row by one draft while Θ rises."""
    R, gamma = conf.shape
    a = conf.double().cumprod(1)
    best, width, tau = R * float(sps[R]), 0, float(R)
    for w in range(1, gamma + 1):
        tau += sum(float(a[r, w - 1]) for r in range(R) if w <= lmax[r])
        theta = tau * float(sps[R * (w + 1)])
        if theta <= best:
            break
        best, width = theta, w
    return [min(width, int(m)) for m in lmax]


def algorithm1(conf: torch.Tensor, lmax: torch.Tensor, sps: torch.Tensor) -> list[int]:
    """The paper's Algorithm 1, line by line (sps indexed by B)."""
    R, gamma = conf.shape
    a = conf.double().cumprod(1)
    cands = [(float(a[r, j]), r, j + 1) for r in range(R) for j in range(int(lmax[r])) if a[r, j] > 0]
    cands.sort(key=lambda c: -c[0])  # stable: row-major order on ties
    ell, B, tau = [0] * R, R, float(R)
    best, chosen = R * float(sps[R]), [0] * R
    for value, r, j in cands:
        ell[r] = j
        B += 1
        tau += value
        theta = tau * float(sps[B])
        if theta > best:
            best, chosen = theta, list(ell)
        else:
            break
    return chosen


# --------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------


def test_registered_through_entry_points():
    reg = plugins.registry()
    assert {"fixed", "threshold", "hardware", "async"} <= set(reg.schedulers)
    assert reg.schedulers["hardware"].plugin == "schedulers"
    assert isinstance(build_scheduler("async", JAGGED), AsyncScheduler)
    with pytest.raises(DspecError, match="needs a cost table"):
        build_scheduler("hardware")
    with pytest.raises(DspecError, match="unknown scheduler 'nope'"):
        build_scheduler("nope")


def test_fixed_and_threshold():
    conf = torch.tensor([[0.9, 0.4, 0.9], [0.6, 0.7, 0.2], [0.3, 0.9, 0.9]])
    lmax = torch.tensor([3, 1, 3])
    assert FixedScheduler()(Proposal(conf.long(), lmax), lmax).tolist() == [3, 1, 3]  # no confidence needed
    assert ThresholdScheduler()(proposal(conf), lmax).tolist() == [1, 1, 0]
    assert ThresholdScheduler(threshold=0.0)(proposal(conf), lmax).tolist() == [3, 1, 3]
    with pytest.raises(DspecError, match=r"threshold must be in \[0, 1\]"):
        ThresholdScheduler(threshold=1.5)
    with pytest.raises(ValueError, match="needs proposal.confidence"):
        ThresholdScheduler()(Proposal(conf.long(), lmax), lmax)


def test_hardware_reproduces_appendix_a():
    sched = HardwareScheduler(APPENDIX)
    conf = torch.tensor([[0.8, 0.9], [0.8, 0.0]])
    for row in conf:  # each request alone (R = 1): Θ_1 = 0.9 < Θ_0 = 1 stops at once
        assert sched(proposal(row[None]), torch.tensor([2])).tolist() == [0]
        assert RetrospectiveScheduler(APPENDIX)(proposal(row[None]), torch.tensor([2])).item() == (2 if row[1] else 0)


@pytest.mark.parametrize("seed", range(6))
def test_hardware_matches_literal_algorithm_1(seed):
    g = _gen(seed)
    R, gamma = (1, 3, 8, 16, 5, 12)[seed], (2, 4, 7, 3, 6, 5)[seed]
    conf = torch.rand(R, gamma, generator=g, dtype=torch.float64) ** 0.3
    conf[torch.rand(R, gamma, generator=g) < 0.1] = 0.0  # dead candidates (a = 0)
    lmax = torch.randint(0, gamma + 1, (R,), generator=g)
    sps_table = table(sorted((0.2 + torch.rand(R * (gamma + 1), generator=g)).tolist(), reverse=True))
    sched = HardwareScheduler(sps_table, layout="packed")
    got = sched(proposal(conf, lmax), lmax)
    assert got.tolist() == algorithm1(conf, lmax, sps_table.sps_curve(R * (gamma + 1)))
    assert bool((got <= lmax).all())


@pytest.mark.parametrize("seed", range(6))
def test_padded_layout_widens_whole_columns(seed):
    """layout=padded: every row verifies min(w, lmax_r); w grows while Θ(w) = τ·SPS(R·(w+1)) rises."""
    g = _gen(seed)
    R, gamma = (1, 3, 8, 16, 5, 12)[seed], (2, 4, 7, 3, 6, 5)[seed]
    conf = torch.rand(R, gamma, generator=g, dtype=torch.float64) ** 0.3
    conf[torch.rand(R, gamma, generator=g) < 0.1] = 0.0
    lmax = torch.randint(0, gamma + 1, (R,), generator=g)
    sps_table = table(sorted((0.2 + torch.rand(R * (gamma + 1), generator=g)).tolist(), reverse=True))
    got = make("hardware,layout=padded", sps_table)(proposal(conf, lmax), lmax)
    assert got.tolist() == padded_widths(conf, lmax, sps_table.sps_curve(R * (gamma + 1)))
    # Algorithm 1 by candidates prices Σ(ℓ + 1) tokens; by columns a ragged choice costs its widest row
    flat_then_cliff = table([1.0] * R * 2 + [0.5] * R * (gamma + 1))
    assert set(make("hardware,layout=padded", flat_then_cliff)(proposal(conf, lmax), lmax).tolist()) <= {0, 1}


def test_padded_async_width_from_two_rounds_earlier():
    sched = make("async,layout=padded", table([1.0, 1.0] + [0.9] * 4 + [0.5] * 30))  # R = 2: best width 2 (B = 6)
    high, low = torch.full((2, 3), 0.9), torch.full((2, 3), 0.05)
    lmax = torch.tensor([3, 1])
    got = [sched(proposal(c), lmax).tolist() for c in (high, low, low, high)]
    # calls 1-2: early stop on the current round; then the argmax over the round two calls back
    assert got == [[2, 1], [0, 0], [2, 1], [0, 0]]
    with pytest.raises(DspecError, match="layout must be one of packed, padded"):
        make("hardware,layout=ragged", JAGGED)


def test_gate_prices_whole_columns_when_padded():
    curve = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5])  # SPS by B; R = 2, γ = 3
    surv = torch.tensor([0.9, 0.5, 0.1])
    # packed may stop at K = 1 (B = 3, still free); padded must verify whole columns (K = 2, 4, 6)
    assert draft_throughput(surv, 2, curve, 0.0) == pytest.approx(2.9)
    assert draft_throughput(surv, 2, curve, 0.0, padded=True) == pytest.approx(max(3.8 * 0.5, 4.8 * 0.5, 5.0 * 0.5))


def test_async_capacity_comes_from_two_rounds_earlier():
    sched = AsyncScheduler(APPENDIX, layout="packed")
    high, low = torch.tensor([[0.8, 0.9]]), torch.tensor([[0.8, 0.0]])
    lmax = torch.tensor([2])
    # K is the global argmax of Θ over the round two calls back: after `high` K = 2 (Θ_2 = 1.134),
    # after `low` K = 0; the first two calls (no history) use Algorithm 1 on the current round: 0
    calls = [high, low, low, high, high, high]
    got = [sched(proposal(c), lmax).item() for c in calls]
    assert got == [0, 0, 1, 0, 0, 2]  # call 3: K = 2 but a_2 = 0 is never admitted
    sched.reset()
    assert sched(proposal(high), lmax).item() == 0  # history cleared: warm-up again


def test_async_admits_top_k_of_current_survivals():
    sched = AsyncScheduler(table([1.0] * 40), layout="packed")  # flat SPS: the global search admits every candidate
    old = torch.full((4, 3), 0.5)
    for _ in range(2):
        sched(proposal(old), torch.tensor([3, 3, 3, 3]))  # K = 12 from these
    cur = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9], [0.9, 0.5, 0.1], [0.6, 0.6, 0.6]])
    assert sched(proposal(cur), torch.tensor([3, 1, 2, 0])).tolist() == [3, 1, 2, 0]
    small = AsyncScheduler(table([1.0, 1.0, 1.0, 1.0, 0.1, 0.1] + [0.01] * 30), layout="packed")  # a cliff after B = 4
    for _ in range(2):
        small(proposal(torch.full((1, 3), 0.99)), torch.tensor([3]))
    # R = 2 now: Θ(K) = (2 + Σ a) · SPS(2 + K) peaks at K = 2 (B = 4); the top-2 current survivals win
    got = small(proposal(torch.tensor([[0.95, 0.9, 0.9], [0.97, 0.1, 0.9]])), torch.tensor([3, 3]))
    assert got.tolist() == [1, 1]  # a = 0.97 (row 1), 0.95 (row 0) beat 0.855


# --------------------------------------------------------------------------------------
# Non-anticipation: ℓ_r >= k must not change when c_{r,k+1..} (functions of x_k) change
# --------------------------------------------------------------------------------------


def anticipation_violations(make, rounds: int = 20, seed: int = 0) -> int:
    """Count (r, k) whose admission flips when only the confidences after position k change."""
    g = _gen(seed)
    violations = 0
    for _ in range(rounds):
        R, gamma = 3, 4
        sched = make()
        for _ in range(2):  # history for the async scheduler
            sched(proposal(torch.rand(R, gamma, generator=g)), torch.full((R,), gamma))
        conf = torch.rand(R, gamma, generator=g) ** 0.5
        lmax = torch.full((R,), gamma)
        base = copy.deepcopy(sched)(proposal(conf), lmax)
        for r in range(R):
            for k in range(1, gamma):
                for _ in range(4):
                    other = conf.clone()
                    other[r, k:] = torch.rand(gamma - k, generator=g) ** 0.5  # another x_k
                    ell = copy.deepcopy(sched)(proposal(other), lmax)
                    violations += int((ell[r] >= k) != (base[r] >= k))
    return violations


@pytest.mark.parametrize("cost", [JAGGED, DIP], ids=["jagged", "dip"])
@pytest.mark.parametrize("spec", ["fixed", "threshold", "hardware", "async", "hardware,layout=packed", "async,layout=packed"])
def test_schedulers_are_non_anticipating(spec, cost):
    assert anticipation_violations(lambda: make(spec, cost)) == 0


@pytest.mark.parametrize("cls", [RetrospectiveScheduler, RetrospectiveColumns])
def test_retrospective_search_anticipates(cls):
    assert anticipation_violations(lambda: cls(DIP)) > 0


# --------------------------------------------------------------------------------------
# Chi-square losslessness (dspec_cli.testing)
# --------------------------------------------------------------------------------------


def grouped(make, group: int, lengths_seen: list | None = None):
    """Length policy: rows in batches of ``group``, each batch with its own persistent scheduler."""
    pool: dict[int, object] = {}

    def policy(prop: Proposal) -> torch.Tensor:
        out = []
        for i, start in enumerate(range(0, prop.lengths.shape[0], group)):
            rows = slice(start, start + group)
            sched = pool.setdefault(i, make())
            sub = Proposal(tokens=prop.tokens[rows], lengths=prop.lengths[rows], confidence=prop.confidence[rows])
            out.append(sched(sub, prop.lengths[rows]))
        ell = torch.cat(out)
        if lengths_seen is not None:
            lengths_seen.append(ell)
        return ell

    return policy


def _first_two(tokens, target, x0, name, alpha=ALPHA):
    joint = T.exact_target_joint(target, x0, 2)
    T.assert_same_distribution(tokens[:, 0], joint.sum(1), alpha=alpha, name=f"{name}: first token")
    T.assert_same_distribution(tokens, joint, alpha=alpha, name=f"{name}: first two tokens")


def _warm(sched, drafter, group: int, gamma: int, seed: int):
    """Give a scheduler two rounds of history from the same drafter (other requests, the past)."""
    vocab = drafter.model.vocab_size
    for i in range(2):
        prop = drafter.propose(torch.randint(vocab, (group,), generator=_gen(seed + i)), gamma, _gen(seed + 10 + i))
        sched(prop, prop.lengths)
    return sched


# rows per scheduler call: batch-level schedulers see one request at a time, as in Appendix A
GROUP = {"fixed": 10**6, "threshold": 10**6, "hardware": 1, "async": 1}


SPECS = ["fixed", "threshold", "hardware,layout=packed", "async,layout=packed", "hardware", "async"]


@pytest.mark.parametrize("spec", SPECS)
def test_appendix_a_lossless(spec):
    ex = T.appendix_a()
    name = spec.split(",")[0]
    build = lambda: _warm(make(spec, APPENDIX), ex.drafter, 1, ex.gamma, 5)  # noqa: E731
    tokens = T.simulate_speculative(
        ex.target, ex.drafter, num_requests=1200, gamma=ex.gamma, num_tokens=2, x0=ex.anchor,
        length_policy=grouped(build, GROUP[name]), generator=_gen(40 + SPECS.index(spec)),
    )
    _first_two(tokens, ex.target, ex.anchor, f"appendix A, {spec}")


@pytest.mark.parametrize("cls", [RetrospectiveScheduler, RetrospectiveColumns])
def test_appendix_a_retrospective_is_caught(cls):
    ex = T.appendix_a()
    tokens = T.simulate_speculative(
        ex.target, ex.drafter, num_requests=1200, gamma=ex.gamma, num_tokens=1, x0=ex.anchor,
        length_policy=grouped(lambda: cls(APPENDIX), 1), generator=_gen(49),
    )
    assert T.gof_test(tokens[:, 0], ex.target_first).p_value < 1e-12
    T.assert_same_distribution(tokens[:, 0], ex.retrospective_first, alpha=ALPHA, name="the paper's (0.85, 0.15)")


@pytest.mark.parametrize("spec", ["threshold", "hardware", "async", "hardware,layout=packed", "async,layout=packed"])
def test_markov_confidence_lossless(spec):
    """Random Markov target/drafter, confidence c_k = table[x_{k-1}], 4 requests per batch."""
    g = _gen(70)
    target = T.ToyLM.random(6, generator=g)
    drafter = T.ToyDrafter(T.ToyLM.random(6, scale=1.5, generator=g),
                           confidence_table=0.1 + 0.85 * torch.rand(6, generator=g))
    seen: list = []
    warm_seeds = itertools.count(7)  # each batch's scheduler gets its own history (async decides from it)
    build = lambda: _warm(make(spec, SMOOTH if "packed" in spec else COLUMNS), drafter, 4, 3, 2 * next(warm_seeds))  # noqa: E731
    tokens = T.simulate_speculative(
        target, drafter, num_requests=3200, gamma=3, num_tokens=2, x0=2,
        length_policy=grouped(build, 4 if spec != "threshold" else GROUP[spec], seen), generator=_gen(71),
    )
    _first_two(tokens, target, 2, f"markov, {spec}")
    counts = torch.bincount(torch.cat(seen), minlength=4)
    assert int((counts > 100).sum()) >= 2, f"decisions barely vary: {counts.tolist()}"


# --------------------------------------------------------------------------------------
# Through the engine
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


DraftModel = plugins.get_drafter_class("draft-model")


class MarkovConfidenceDraft(DraftModel):
    """``draft-model`` with a Markov-style confidence c_k = h(x_{k-1}) (x_0 = the anchor), never x_k."""

    def propose(self, state, anchors, max_len, sampler):
        prop = super().propose(state, anchors, max_len, sampler)
        prev = torch.cat([anchors[:, None], prop.tokens[:, :-1]], 1)  # [R, γ]
        prop.confidence = 0.1 + 0.85 * ((prev * 0.6180339) % 1.0)
        return prop


def draft_model(target: Target, block_size: int = 3, cls=DraftModel):
    return cls(cls.config_class(block_size=block_size), target, model=Target(tiny_qwen3(seed=1), tiny_tokenizer()))


@pytest.mark.parametrize("name", ["hardware", "async"])
def test_engine_greedy_identity_and_budgets(target, name):
    prompts = [target.render_prompt(p) for p in ("The quick brown fox", "def add(a, b):", "Numbers like 0 1 2")]
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, block_size=3, max_batch=3)
    sched = build_scheduler(name, table([1.0] * 4 + [0.9] * 4 + [0.5] * 8))
    drafter = draft_model(target)
    fixed = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)
    got = SpeculativeEngine(target, drafter, cfg, scheduler=sched, stop_ids=[]).generate(prompts)
    assert [r.output_ids for r in got] == [r.output_ids for r in fixed]
    assert sum(sum(r.verified) for r in got) < sum(sum(r.verified) for r in fixed)  # the budget binds
    assert all(len(c) == v for r in got for c, v in zip(r.confidence, r.verified, strict=False))  # drafted rounds


def test_engine_keeps_a_fixed_context_and_tracks_it_otherwise(target):
    prompts = [target.render_prompt(p) for p in ("The quick brown fox", "def add(a, b):")]
    cfg = GenerationConfig(max_new_tokens=6, temperature=0.0, block_size=3, max_batch=2)
    costs = table([1.0] * 4 + [0.9] * 4 + [0.5] * 8)
    fixed, tracked = build_scheduler("hardware", costs, context=1000.0), build_scheduler("hardware", costs)
    for sched in (fixed, tracked):
        SpeculativeEngine(target, draft_model(target), cfg, scheduler=sched, stop_ids=[]).generate(prompts)
    assert fixed.context == 1000.0
    assert tracked.context is not None and tracked.context < 100  # the batch's mean context of the last round


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_engine_lossless_with_hardware_scheduler(target, layout):
    """Two-token continuations through the engine: hardware scheduler, Markov-style confidences."""
    prompt = target.render_prompt("Speculative decoding drafts")
    rows = 50 if layout == "packed" else 8  # whole columns: few rows, so the width varies between rounds
    cfg = GenerationConfig(max_new_tokens=3, block_size=3, max_batch=rows, seed=3)
    costs = table([1.0] * 50 + [1.0 / (1.0 + 0.01 * i) for i in range(1, 200)]) if layout == "packed" else COLUMNS_8
    sched = build_scheduler("hardware", costs, gate=False, layout=layout)
    drafter = draft_model(target, cls=MarkovConfidenceDraft)
    results = SpeculativeEngine(target, drafter, cfg, scheduler=sched, stop_ids=[]).generate([prompt] * 2000)
    samples = torch.tensor([r.output_ids[:2] for r in results])
    T.assert_continuations_match(samples, T.exact_continuations(target, prompt, depth=2, min_prob=1e-3),
                                 alpha=ALPHA, name="engine + hardware scheduler")
    first = torch.bincount(torch.tensor([r.verified[0] for r in results]), minlength=3)
    assert int((first > 50).sum()) >= 2, f"ℓ barely varies: {first.tolist()}"



# --------------------------------------------------------------------------------------
# Offline load simulation and `dspec schedule`
# --------------------------------------------------------------------------------------


def toy_rounds(n: int = 400, gamma: int = 4, seed: int = 0) -> Rounds:
    g = _gen(seed)
    conf = 0.05 + 0.9 * torch.rand(n, gamma, generator=g, dtype=torch.float64)
    accepted = (torch.rand(n, gamma, generator=g, dtype=torch.float64) < conf).long().cumprod(1).sum(1)
    return Rounds(conf, torch.full((n,), gamma), accepted)


def test_simulate_load():
    rounds = toy_rounds()
    flat = table([10.0] * 64)
    fixed = simulate_load(FixedScheduler(), rounds, flat, concurrency=4, steps=50, generator=_gen(1))
    assert fixed["budget"] == pytest.approx(5.0) and fixed["mean_draft_len"] == pytest.approx(4.0)
    hw = simulate_load(HardwareScheduler(flat), rounds, flat, concurrency=4, steps=50, generator=_gen(1))
    assert hw["budget"] == pytest.approx(5.0) and hw["tau"] == pytest.approx(fixed["tau"])  # free tokens: take all
    steep = table([10.0] * 4 + [1.0] * 600)  # any draft costs 10x
    none = simulate_load(HardwareScheduler(steep), rounds, steep, concurrency=4, steps=20, generator=_gen(1))
    assert none["budget"] == pytest.approx(1.0) and none["tau"] == pytest.approx(1.0)
    curve = table([100.0 / max(1.0, b / 16) for b in range(1, 600)])
    budgets = [simulate_load(HardwareScheduler(curve), rounds, curve, concurrency=r, steps=30,
                             generator=_gen(2))["budget"] for r in (1, 8, 64)]
    assert budgets[0] > budgets[1] > budgets[2]  # the budget shrinks under load (Fig. 8)
    with pytest.raises(DspecError, match="--concurrency"):
        simulate_load(FixedScheduler(), rounds, flat, concurrency=0)


def test_simulate_load_padded_engine_pays_the_widest_row():
    rounds = toy_rounds()
    cliff = table([10.0] * 8 + [1.0] * 600)  # R = 4: two tokens per row are free, a third costs 10x
    threshold = ThresholdScheduler(threshold=0.5)  # ragged ℓ
    packed = simulate_load(threshold, rounds, cliff, concurrency=4, steps=40, generator=_gen(3))
    padded = simulate_load(threshold, rounds, cliff, concurrency=4, steps=40, generator=_gen(3), layout="padded")
    assert packed["tau"] == padded["tau"] and padded["layout"] == "padded"
    assert padded["tokens_per_s"] < packed["tokens_per_s"]  # the same choices priced as the grid
    by_layout = {layout: simulate_load(make(f"hardware,layout={layout}", cliff), rounds, cliff, concurrency=4,
                                       steps=40, generator=_gen(3), layout="padded") for layout in ("packed", "padded")}
    # Algorithm 1 by candidates spends the 4 free tokens raggedly and pays for the grid; by columns it stays free
    assert by_layout["padded"]["tokens_per_s"] > 2 * by_layout["packed"]["tokens_per_s"]
    with pytest.raises(DspecError, match="--layout must be packed or padded"):
        simulate_load(threshold, rounds, cliff, concurrency=4, layout="ragged")






@pytest.fixture()
def files(tmp_path):
    ct = tmp_path / "cost.json"
    table([100.0 / max(1.0, b / 16) for b in range(1, 300)], name="NVIDIA H200", model="Qwen/Qwen3-4B").save(ct)
    tr = tmp_path / "traces.jsonl"
    save_traces(tr, toy_rounds(), drafter="dspark-markov", block_size=4, verify="token")
    return ct, tr


def test_schedule_cli(files, tmp_path, capsys):
    ct, tr = files
    out, png = tmp_path / "sched.json", tmp_path / "png" / "schedule.png"
    code, stdout, _ = run(["schedule", "--cost-table", str(ct), "--traces", str(tr), "-s", "hardware", "-s", "async",
                           "-s", "fixed", "--concurrency", "1,8,64", "--steps", "20", "--json", str(out),
                           "--plots", str(png.parent)], capsys)
    assert code == 0 and "hardware" in stdout
    report = json.loads(out.read_text())
    assert report["drafter"] == "dspark-markov" and report["block_size"] == 4 and len(report["results"]) == 9
    assert report["layout"] == "padded"  # the layout bench's hardware scheduler models
    hw = [r for r in report["results"] if r["scheduler"] == "hardware"]
    assert [r["concurrency"] for r in hw] == [1, 8, 64] and hw[0]["budget"] > hw[-1]["budget"]
    assert png.stat().st_size > 1000


def test_schedule_cli_cost_table_checks(files, capsys):
    ct, tr = files
    code, _, err = run(["schedule", "--cost-table", str(ct), "--traces", str(tr), "--steps", "2", "--device", "cpu",
                        "--target", "other/model"], capsys)
    assert code == 0 and "Warning:" in err and "NVIDIA H200" in err and "other/model" in err
    _bad(["schedule", "--cost-table", str(ct), "--traces", str(tr), "--device", "cpu", "--strict"], capsys,
         "was profiled on 'NVIDIA H200'")


def test_schedule_cli_bad_input(files, tmp_path, capsys):
    ct, tr = files
    base = ["schedule", "--cost-table", str(ct), "--traces", str(tr)]
    _bad(base + ["--concurrency", "0"], capsys, "--concurrency values must be >= 1")
    _bad(base + ["--concurrency", "1,x"], capsys, "--concurrency must be a comma-separated list")
    _bad(base + ["-s", "nope"], capsys, "unknown scheduler 'nope'")
    cal = tmp_path / "calibration.json"
    Calibration.sts("dflash", 4, [1.0] * 4).save(cal)
    _bad(base + ["--calibration", str(cal)], capsys, "is for drafter 'dflash', not 'dspark-markov'")
    Calibration.sts("dspark-markov", 7, [1.0] * 7).save(cal)
    _bad(base + ["--calibration", str(cal)], capsys, "is for block size 7, not 4")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"confidence": [0.5, 1.0], "accepted": 1}\n')
    _bad(["schedule", "--cost-table", str(ct), "--traces", str(bad)], capsys,
         "bad.jsonl:1: confidence values must lie in (0, 1)")
    broken = tmp_path / "broken.json"
    broken.write_text('{"device": "cpu"}')
    _bad(["schedule", "--cost-table", str(broken), "--traces", str(tr)], capsys, "broken.json: device_name: missing")
