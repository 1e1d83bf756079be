"""The draft gate: rounds without a draft (decision from past rounds only), the drafter's
lag (deferred admissions and skipped rounds) and losslessness of mixed rounds through the engine."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3, tiny_target, tiny_tokenizer

from dspec_cli import testing as T
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.drafter_lag import DrafterLag
from dspec_cli.runtime.engine import GenerationConfig, RoundSampler, SpeculativeEngine
from dspec_cli.runtime.schedule import (
    DraftGate,
    HardwareScheduler,
    Rate,
    build_scheduler,
    draft_throughput,
)
from dspec_cli.runtime.target import Target


def table(sps: list[float]) -> CostTable:
    """SPS(B) = sps[B-1] (one context)."""
    return CostTable(device="cpu", device_name="cpu-test", dtype="float32", model="toy", torch=torch.__version__,
                     grid=list(range(1, len(sps) + 1)), contexts=[128], measured={"128": list(sps)})


def curve(sps: list[float]):
    """The lazy SPS curve :meth:`DraftGate.decide` takes."""
    values = table(sps).sps_curve(len(sps))
    return lambda: values


# a CPU-like curve: one token 10 ms, each extra token +1 ms
CPU = [1.0 / (0.010 + 0.001 * (b - 1)) for b in range(1, 257)]


# --------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------


def test_draft_throughput_is_the_best_budget():
    a = torch.tensor([0.9, 0.6, 0.2], dtype=torch.float64)
    sps = curve(CPU)()
    R, t = 2, 0.004
    best = 0.0
    for k in range(1, 3 * R + 1):  # brute force over budgets: the k largest of ā repeated R times
        top = sorted(a.repeat(R).tolist(), reverse=True)[:k]
        best = max(best, (R + sum(top)) / (1 / float(sps[R + k]) + t))
    assert draft_throughput(a, R, sps, t) == pytest.approx(best)


def gate_after(survival: list[float], draft_seconds: float, **kwargs) -> DraftGate:
    gate = DraftGate(draft_seconds=draft_seconds, **kwargs)
    gate.observe_survival(torch.tensor([survival], dtype=torch.float64))
    return gate


def test_gate_opens_when_drafting_pays_and_closes_when_not():
    sps = curve(CPU)
    good = [0.95, 0.9, 0.85, 0.8]
    assert gate_after(good, 0.001).decide(1, sps)  # cheap draft, long expected accepts
    assert not gate_after(good, 0.050).decide(1, sps)  # drafting costs 5 plain steps
    assert not gate_after([0.1, 0.01, 0.0, 0.0], 0.001).decide(1, sps)  # drafts rarely survive
    assert DraftGate().decide(4, sps)  # no history: draft (and measure)


def test_gate_probes_for_a_share_of_the_time():
    """Closed, it drafts once the closed rounds' step time (10 ms each at R = 1) times
    probe_share reaches the drafting time: 0.99 ms / 0.025 = 39.6 ms -> every 4th round."""
    gate = gate_after([0.1, 0.01, 0.0, 0.0], 0.00099, probe_share=0.025)
    decisions = [gate.decide(1, curve(CPU)) for _ in range(12)]
    assert [i for i, d in enumerate(decisions) if d] == [3, 7, 11]
    assert (gate.opened, gate.closed) == (3, 9)


def test_gate_probes_across_short_runs():
    """The closed time that pays for a probe carries over from run to run: requests shorter than
    the probe interval (3 closed rounds each, a probe due every 4th round) still get probes."""
    gate = gate_after([0.1, 0.01, 0.0, 0.0], 0.00099, probe_share=0.025)
    decisions = []
    for _ in range(4):
        gate.new_run()
        decisions += [gate.decide(1, curve(CPU)) for _ in range(3)]
    assert [i for i, d in enumerate(decisions) if d] == [3, 7, 11]


def test_gate_prices_probes_by_measured_round_times():
    """Measured costs: closed rounds count the measured plain round (20 ms at R = 1, not the
    table's 10 ms) and a probe costs drafted − plain round time (51 − 20 = 31 ms, more than its
    1 ms of drafting): 31 ms / 0.1 = 310 ms of closed rounds -> every 16th round."""
    gate = gate_after([0.01, 0.0, 0.0, 0.0], None, probe_share=0.1)  # closed, with or without o = 10 ms
    gate.observe_time(1, 0.001)
    gate.observe_round(1, 0.051, drafted=True)
    gate.observe_round(1, 0.020, drafted=False)
    assert gate._probe_cost(1) == pytest.approx(0.031) and gate._probe_cost(64) == pytest.approx(0.031)
    decisions = [gate.decide(1, curve(CPU)) for _ in range(32)]
    assert [i for i, d in enumerate(decisions) if d] == [15, 31]
    cheap = gate_after([0.1, 0.01, 0.0, 0.0], None)
    cheap.observe_time(1, 0.005)
    cheap.observe_round(1, 0.022, drafted=True)
    cheap.observe_round(1, 0.020, drafted=False)
    assert cheap._probe_cost(1) == pytest.approx(0.005)  # never below the drafting time
    fixed = gate_after([0.1, 0.01, 0.0, 0.0], 0.001, probe_share=0.1)
    fixed.observe_round(1, 0.051, drafted=True)
    fixed.observe_round(1, 0.020, drafted=False)
    assert fixed._probe_cost(1) == 0.001  # a fixed draft_seconds: the cost model only (deterministic)


def test_gate_keeps_estimates_across_runs():
    sched = build_scheduler("hardware", table(CPU), draft_seconds=0.05)
    sched.gate.observe_survival(torch.tensor([[0.5, 0.2, 0.1, 0.0]], dtype=torch.float64))
    sched.gate.decide(1, curve(CPU))
    sched.reset()  # what the engine does at the start of a run
    assert sched.gate.survival is not None and (sched.gate.opened, sched.gate.closed) == (0, 0)
    sched.gate.reset()
    assert sched.gate.survival is None


def test_gate_measures_draft_time_per_concurrency():
    gate = DraftGate(smoothing=0.5)
    gate.observe_survival(torch.tensor([[0.95, 0.9, 0.85, 0.8]], dtype=torch.float64))
    gate.observe_time(1, 0.001)
    gate.observe_time(16, 0.200)
    gate.observe_time(16, 0.100)
    assert gate.times == {1: 0.001, 16: pytest.approx(0.150)}
    assert gate.decide(2, curve(CPU))  # nearest measured R is 1: cheap
    assert not gate.decide(12, curve(CPU))  # nearest is 16: expensive


def test_gate_options_and_errors():
    sched = build_scheduler("hardware", table(CPU), draft_seconds=0.01, probe_share=0.1)
    assert sched.gate.draft_seconds == 0.01 and sched.gate.probe_share == 0.1
    assert build_scheduler("async", table(CPU), gate=False).gate is None
    assert build_scheduler("fixed").wants_draft(3, 4)
    with pytest.raises(DspecError, match="probe_share"):
        build_scheduler("hardware", table(CPU), probe_share=0.0)
    with pytest.raises(DspecError, match="draft_seconds"):
        build_scheduler("hardware", table(CPU), draft_seconds=-1.0)


# --------------------------------------------------------------------------------------
# Catch-up: one advance over skipped rounds == one advance per round
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


def make(name: str, target: Target):
    cls = get_drafter_class(name)
    torch.manual_seed(1)
    if name == "draft-model":
        return cls(cls.config_class(block_size=4), target, model=Target(tiny_qwen3(seed=1), tiny_tokenizer()))
    extra = {} if name in ("dflash", "eagle3") else {"markov_rank": 16}
    if name != "eagle3":
        extra["num_layers"] = 2
    return cls.build(cls.config_class(block_size=4, **extra), target)


def greedy_sampler(rows: int) -> RoundSampler:
    zeros = torch.zeros(rows, dtype=torch.long)
    return RoundSampler(GenerationConfig(temperature=0.0), zeros, zeros + 1, 4)


def _commits(rounds: list[list[int]], width: int, g: torch.Generator, taps: bool):
    """Random committed tokens (and taps) of rounds with the given per-row counts."""
    out = []
    for counts in rounds:
        n = sum(counts)
        out.append((torch.randint(200, (n,), generator=g), torch.tensor(counts),
                    torch.randn(n, width, generator=g) if taps else None))
    return out


@pytest.mark.parametrize("name", ["dflash", "dspark-markov", "eagle3", "draft-model"])
def test_lag_flush_equals_eager_updates(target, name):
    """Two runs of the same events, compared by the next greedy proposal: eager (add_requests and
    one advance per round, as when every round drafts) and lagged (DrafterLag: a drafted round,
    then skipped rounds, a request leaving and a request that joined and was never drafted for)."""
    drafter = make(name, target)
    width = len(drafter.target_layer_ids) * target.hidden_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(200, (n,), generator=g) for n in (7, 4, 5)]
    taps = [torch.randn(p.numel(), width, generator=g) for p in prompts] if drafter.target_layer_ids else None
    first = _commits([[3, 1]], width, g, taps is not None)[0]  # a drafted round of rows 0, 1
    skipped = _commits([[1, 1, 1], [2, 1, 1]], width, g, taps is not None)  # row 2 joined before these
    after = _commits([[1, 1]], width, g, taps is not None)[0]  # row 1 has left
    proposals = []
    for lagged in (False, True):
        state, lag = drafter.init_state(), DrafterLag()
        if lagged:
            lag.admit(prompts[:2], taps[:2] if taps else None)
            lag.flush(drafter, state)
        else:
            drafter.add_requests(state, prompts[:2], taps[:2] if taps else None)
        drafter.propose(state, torch.tensor([5, 9]), 4, greedy_sampler(2))
        drafter.advance(state, *first)
        if lagged:
            lag.admit(prompts[2:], taps[2:] if taps else None)
            for c in skipped:
                lag.skip(*c)
            lag.keep(drafter, state, [0, 2])
            lag.skip(*after)
            assert (lag.admitted, len(lag.pending), len(lag.backlog)) == (1, 1, 3)  # row 1's entries stay until the flush
            lag.flush(drafter, state)
            assert (lag.admitted, lag.pending, lag.backlog) == (2, [], [])
        else:
            drafter.add_requests(state, prompts[2:], taps[2:] if taps else None)
            for c in skipped:
                drafter.advance(state, *c)
            drafter.remove_requests(state, [0, 2])
            drafter.advance(state, *after)
        proposals.append(drafter.propose(state, torch.tensor([5, 11]), 4, greedy_sampler(2)))
    eager, lagged = proposals
    assert torch.equal(eager.tokens, lagged.tokens)
    torch.testing.assert_close(eager.draft_probs, lagged.draft_probs)


def test_lag_orders_tokens_per_row():
    seen = []

    class Recorder:
        def add_requests(self, state, prompts, hidden):
            seen.append(("add", [p.tolist() for p in prompts]))

        def advance(self, state, committed, counts, hidden):
            seen.append(("advance", committed.tolist(), counts.tolist(), hidden[:, 0].tolist()))

        def remove_requests(self, state, keep):
            seen.append(("remove", keep))

    lag = DrafterLag(admitted=2)
    lag.skip(torch.tensor([10, 11, 20]), torch.tensor([2, 1]), torch.tensor([[10.0], [11.0], [20.0]]))
    lag.admit([torch.tensor([7, 7])], [torch.zeros(2, 1)])  # a third row joins
    lag.skip(torch.tensor([12, 21, 30]), torch.tensor([1, 1, 1]), torch.tensor([[12.0], [21.0], [30.0]]))
    lag.flush(Recorder(), None)
    assert seen == [("add", [[7, 7]]), ("advance", [10, 11, 12, 20, 21, 30], [3, 2, 1], [10.0, 11.0, 12.0, 20.0, 21.0, 30.0])]
    seen.clear()
    lag.skip(torch.tensor([13, 22, 31]), torch.tensor([1, 1, 1]), torch.tensor([[13.0], [22.0], [31.0]]))
    lag.keep(Recorder(), None, [0, 2])  # row 1 leaves: the drafter drops it, the flush its entries
    assert len(lag.backlog) == 1  # no copy: 1 dead entry, 2 live
    lag.flush(Recorder(), None)
    assert seen == [("remove", [0, 2]), ("advance", [13, 31], [1, 1], [13.0, 31.0])]
    seen.clear()
    lag.skip(torch.tensor([14, 32]), torch.tensor([1, 1]), torch.tensor([[14.0], [32.0]]))
    lag.admit([torch.tensor([8])], [torch.zeros(1, 1)])  # row 2 (pending) joins
    lag.skip(torch.tensor([15, 33, 40]), torch.tensor([1, 1, 1]), torch.tensor([[15.0], [33.0], [40.0]]))
    lag.keep(Recorder(), None, [1, 2])  # row 0 leaves with 2 entries against 3 live: kept
    assert len(lag.backlog) == 2
    lag.keep(Recorder(), None, [0])  # the pending row leaves with 1 more: 3 dead > 2 live, compacted
    assert len(lag.backlog) == 1 and lag.backlog[0][1].tolist() == [32, 33]
    lag.flush(Recorder(), None)
    assert seen == [("remove", [1]), ("advance", [32, 33], [2], [32.0, 33.0])]


# --------------------------------------------------------------------------------------
# Through the engine: mixed drafted / plain rounds stay lossless; peeking is caught
# --------------------------------------------------------------------------------------


class MarkovConfidenceDraft(get_drafter_class("draft-model")):
    """``draft-model`` with confidence c_k = h(x_{k-1}) (x_0 = the anchor), never x_k."""

    def propose(self, state, anchors, max_len, sampler):
        prop = super().propose(state, anchors, max_len, sampler)
        prev = torch.cat([anchors[:, None], prop.tokens[:, :-1]], 1)  # [R, γ]
        prop.confidence = 0.1 + 0.85 * ((prev * 0.6180339) % 1.0)
        return prop


class PeekingScheduler(HardwareScheduler):
    """A wrong gate: drafts, then skips the rows whose second confidence (a function of x_1) is
    low — the round's decision sees the draft. NOT lossless."""

    def lengths(self, confidence, lmax):
        ell = super().lengths(confidence, lmax)
        return torch.where(confidence[:, 1] < 0.5, torch.zeros_like(ell), ell)


# flat SPS up to 40 tokens: drafts are cheap to verify, so whether a round drafts is up to the gate
FLAT = [1.0] * 40 + [1.0 / (1.0 + 0.02 * i) for i in range(1, 200)]


def _samples(target, scheduler, n: int = 2000):
    """Two-token continuations at T = 0.5 (peaked: few bins); the target is its own draft model (q = p: a verified x_1 is
    always accepted, so a gate that peeks at x_1 shifts the output as much as it can)."""
    prompt = target.render_prompt("Speculative decoding drafts")
    cfg = GenerationConfig(max_new_tokens=3, block_size=3, max_batch=10, seed=5, temperature=0.5)
    drafter = MarkovConfidenceDraft(MarkovConfidenceDraft.config_class(block_size=3), target, model=target)
    engine = SpeculativeEngine(target, drafter, cfg, scheduler=scheduler, stop_ids=[])
    results = engine.generate([prompt] * n)
    exact = T.exact_continuations(target, prompt, depth=2, min_prob=1e-3, temperature=0.5)
    return torch.tensor([r.output_ids[:2] for r in results]), exact, engine.stats


class AlternatingGateScheduler(HardwareScheduler):
    """Drafts every other round, whatever happens: a fixed mix of drafted and plain rounds."""

    def wants_draft(self, num_rows: int, gamma: int) -> bool:
        self.calls = getattr(self, "calls", 0) + 1
        return self.calls % 2 == 0


@pytest.mark.parametrize("gate", ["alternating", "draft-gate"])
def test_engine_lossless_with_draft_gate(target, gate):
    """Drafted and plain rounds mix in one run and the continuations stay exact: a gate that
    alternates, and the real gate with drafting as costly as about one target step (0.97 s
    against 1 s), so it opens and closes with the recent survival curve."""
    if gate == "alternating":
        sched = AlternatingGateScheduler(table(FLAT), gate=False)
    else:
        sched = build_scheduler("hardware", table(FLAT), draft_seconds=0.97, probe_share=0.5)
    samples, exact, stats = _samples(target, sched)
    T.assert_continuations_match(samples, exact, alpha=1e-4, name=f"engine + {gate} gate")
    drafted, plain = stats.drafted_rounds, stats.rounds - stats.drafted_rounds
    assert min(drafted, plain) >= 20, f"the gate did not mix rounds: {drafted} drafted, {plain} plain"


def test_engine_peeking_gate_is_caught(target):
    samples, exact, _ = _samples(target, PeekingScheduler(table(FLAT), gate=False))
    with pytest.raises(AssertionError):
        T.assert_continuations_match(samples, exact, alpha=1e-4, name="peeking gate")


def test_gate_counts_the_measured_per_round_cost_on_both_sides():
    """A plain round measured at 1/SPS(1) + o: o is added to plain and drafted rounds alike,
    which turns a close call towards drafting (the drafted round's forward weighs less)."""
    sps = curve(CPU)()
    survival = [0.6, 0.4, 0.27, 0.18]
    t = 1.5 / float(sps[1])  # drafting costs 1.5 plain forwards
    gate = gate_after(survival, None)
    gate.observe_time(1, t)
    plain_forward = 1.0 / float(sps[1])
    without = draft_throughput(gate.survival, 1, sps, t) / float(sps[1])
    gate.observe_round(1, plain_forward * 2, drafted=False)  # o = one forward
    assert gate.overhead(1, sps) == pytest.approx(plain_forward)
    with_o = draft_throughput(gate.survival, 1, sps, t + plain_forward) * 2 * plain_forward
    assert without < 1.0 < with_o  # the verdict turns: drafting pays once o is counted
    assert gate._predict(1, sps)
    assert DraftGate(draft_seconds=t).overhead(1, sps) == 0.0  # fixed cost: nothing measured


def test_hardware_scheduler_prices_rounds_with_the_gate_estimates():
    """Same confidences: with a measured drafting time Algorithm 1 verifies at least as many
    tokens (extra verified tokens cost relatively less), without a gate it is the paper's."""
    costs = table(CPU)
    conf = torch.tensor([[0.9, 0.7, 0.5, 0.4]])
    lmax = torch.tensor([4])
    plain = HardwareScheduler(costs, gate=False)
    gated = HardwareScheduler(costs)
    gated.gate.observe_time(1, 0.5)  # drafting far costlier than a forward
    proposal = Proposal(tokens=torch.zeros(1, 4, dtype=torch.long), lengths=lmax, confidence=conf)
    assert int(gated(proposal, lmax)) >= int(plain(proposal, lmax))
    assert int(gated(proposal, lmax)) == 4


# --------------------------------------------------------------------------------------
# Measured rates: drafted against plain tokens/s at this R
# --------------------------------------------------------------------------------------


def test_rate_averages_then_smooths():
    rate = Rate()
    for tokens in (2, 4, 6):
        rate.add(tokens, 1.0, alpha=0.25)
    assert rate.tokens == pytest.approx(4.0) and rate.per_second == pytest.approx(4.0)  # mean of the first 1/α
    rate.add(4, 1.0, alpha=0.25)
    rate.add(8, 1.0, alpha=0.25)  # the fifth round has weight α, not 1/5
    assert rate.tokens == pytest.approx(4.0 + 0.25 * (8 - 4.0))


def measured_gate(survival: list[float], **kwargs) -> DraftGate:
    gate = DraftGate(min_rounds=4, **kwargs)
    gate.observe_survival(torch.tensor([survival], dtype=torch.float64))
    gate.observe_time(1, 0.001)
    return gate


def test_measured_rates_overrule_the_prediction():
    """The cost table predicts drafting wins (cheap draft, long accepts), but drafted rounds
    measure 2 tokens in 25 ms against plain 1 token in 10 ms: the gate closes; and the other way."""
    sps = curve(CPU)
    gate = measured_gate([0.95, 0.9, 0.85, 0.8])
    assert gate._predict(1, sps()) and gate.decide(1, sps)
    for _ in range(4):
        gate.observe_round(1, 0.025, True, tokens=2)
    assert gate.measured(1) is None  # no plain round at R = 1 yet
    gate.observe_round(1, 0.010, False, tokens=1)
    assert gate.measured(1) is False and not gate.decide(1, sps)
    pessimist = measured_gate([0.1, 0.01, 0.0, 0.0])
    assert not pessimist._predict(1, sps())
    for _ in range(4):
        pessimist.observe_round(1, 0.030, True, tokens=4, catch_up=0.005)  # 25 ms without the catch-up
    pessimist.observe_round(1, 0.010, False, tokens=1)
    assert pessimist.rates[1, True].per_second == pytest.approx(4 / 0.025)
    assert pessimist.measured(1) is True and pessimist.decide(1, sps)
    assert pessimist.measured(4) is None  # rates are per concurrency
    assert DraftGate(draft_seconds=0.001).measure is False and DraftGate(measure=False).measure is False


def test_open_gate_runs_plain_probes():
    """Open on measured rates, a plain probe comes once the open rounds' time (10 ms each)
    times probe_share (0.1) reaches a plain round's (5 ms): every 5th decision; the first
    comes as soon as min_rounds drafted rounds are in and no plain one is."""
    gate = measured_gate([0.95, 0.9, 0.85, 0.8], probe_share=0.1)
    for _ in range(4):
        gate.observe_round(1, 0.010, True, tokens=3)
    assert gate.decide(1, curve(CPU)) is False  # first plain measurement
    gate.observe_round(1, 0.005, False, tokens=1)
    decisions = [gate.decide(1, curve(CPU)) for _ in range(10)]
    assert [i for i, d in enumerate(decisions) if not d] == [4, 9]
    off = measured_gate([0.95, 0.9, 0.85, 0.8], measure=False)
    for _ in range(4):
        off.observe_round(1, 0.010, True, tokens=3)
    assert all(off.decide(1, curve(CPU)) for _ in range(20))  # the model alone: no plain probes


class FakeClockScheduler(HardwareScheduler):
    """The real gate on measured rates, with a fake clock: a plain round takes 1 s, a drafted one
    2.4 s, so drafting wins when the last rounds committed more than 2.4 tokens per row. Whether
    a round drafts depends on how many drafts earlier rounds accepted."""

    def observe_round(self, num_rows, seconds, drafted, tokens=None, catch_up=0.0):
        super().observe_round(num_rows, 2.4 if drafted else 1.0, drafted, tokens * 10 // num_rows)


def test_engine_lossless_with_measured_gate(target):
    sched = FakeClockScheduler(table(FLAT), probe_share=0.5)
    sched.gate.min_rounds, sched.gate.rate_smoothing = 2, 0.5
    samples, exact, stats = _samples(target, sched)
    T.assert_continuations_match(samples, exact, alpha=1e-4, name="engine + measured gate")
    drafted, plain = stats.drafted_rounds, stats.rounds - stats.drafted_rounds
    assert min(drafted, plain) >= 20, f"the gate did not mix rounds: {drafted} drafted, {plain} plain"


def test_closed_gate_explores_to_measure():
    """Closed by the prediction with no usable drafted rate at R, the gate drafts min_rounds
    rounds in a row after 4 · min_rounds closed ones; then the measured rates decide."""
    gate = measured_gate([0.1, 0.01, 0.0, 0.0], probe_share=1e-6)  # probes out of the way
    decisions = []
    for _ in range(40):
        decisions.append(gate.decide(1, curve(CPU)))
        gate.observe_round(1, 0.010, decisions[-1], tokens=3 if decisions[-1] else 1)
    assert decisions[:16] == [False] * 16 and decisions[16:20] == [True] * 4  # 4 · 4 closed, then 4 drafted
    assert gate.measured(1) is True and all(decisions[20:])  # 3 tokens per 10 ms beats 1
    assert not any(measured_gate([0.1, 0.01, 0.0, 0.0], probe_share=1e-6, measure=False).decide(1, curve(CPU))
                   for _ in range(40))
    silent = measured_gate([0.1, 0.01, 0.0, 0.0], probe_share=1e-6)  # rounds reported without tokens
    for _ in range(40):
        silent.observe_round(1, 0.010, silent.decide(1, curve(CPU)))
    assert (silent.opened, silent.explored) == (0, {})  # nothing to measure with: no measuring run


def test_measured_verdicts_carry_to_unmeasured_concurrencies():
    """Drafting measured to lose at R = 4 closes the gate at R = 16 and R = 64 without a
    measuring run there, but says nothing about R = 1; drafting measured to win at R = 4 opens
    it at R = 1 and R = 2 (where the prediction would close it) but not at R = 16. R's own
    measurements still come first."""
    sps = curve(CPU)

    def measured_at(rows: int, drafted_tokens: int) -> DraftGate:
        gate = measured_gate([0.1, 0.01, 0.0, 0.0], probe_share=1e-6)  # the prediction: closed
        for _ in range(4):
            gate.observe_round(rows, 0.010, True, tokens=drafted_tokens)
        gate.observe_round(rows, 0.010, False, tokens=rows)
        return gate

    loses = measured_at(4, drafted_tokens=2)  # 2 tokens per drafted round against 4 plain
    assert loses.measured(4) is False
    assert (loses.inferred(16), loses.inferred(64), loses.inferred(1)) == (False, False, None)
    for _ in range(40):  # no measuring run at R = 16
        assert not loses.decide(16, sps)
        loses.observe_round(16, 0.010, False, tokens=16)
    assert loses.explored == {}
    wins = measured_at(4, drafted_tokens=12)
    assert (wins.inferred(1), wins.inferred(2), wins.inferred(16)) == (True, True, None)
    assert not wins._predict(1, sps()) and wins.decide(1, sps)
    for _ in range(4):  # R = 16's own rates: drafting wins there too
        wins.observe_round(16, 0.010, True, tokens=40)
    wins.observe_round(16, 0.010, False, tokens=16)
    assert wins.measured(16) is True and wins.inferred(8) is True
    both = measured_at(4, drafted_tokens=2)
    for _ in range(4):
        both.observe_round(16, 0.010, True, tokens=40)
    both.observe_round(16, 0.010, False, tokens=16)
    assert both.inferred(8) is None  # R = 4 loses, R = 16 wins: no monotone verdict in between


def test_a_slowdown_of_the_whole_machine_does_not_open_the_gate():
    """Drafted rounds were measured at 0.8x plain decoding while the machine was fast; then every
    round takes twice as long. The plain rate falls at once, the drafted rate would only follow
    at the next drafted rounds, but each drafted round was priced against the plain rate of its
    own time: the gate stays closed."""
    gate = measured_gate([0.1, 0.01, 0.0, 0.0], probe_share=1e-6)
    gate.observe_round(4, 0.010, False, tokens=4)
    for _ in range(4):  # 8 tokens per 25 ms against 4 per 10 ms: 0.8x
        gate.observe_round(4, 0.025, True, tokens=8)
    assert gate.measured(4) is False
    for _ in range(200):  # the slow phase: plain rounds take 20 ms
        assert not gate.decide(4, curve(CPU))
        gate.observe_round(4, 0.020, False, tokens=4)
    assert gate.rates[4, True].per_second > gate.rates[4, False].per_second  # unpaired rates would open it
    assert gate.measured(4) is False
