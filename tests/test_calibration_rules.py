"""Calibration per verification rule: the survival map recovers the exact prefix survival of the
token and the block rule on rounds verified by dspec's own verifier, a calibration applied under
a rule it was not fitted for warns (engine, bench, ``dspec schedule``) and is refused by the
SGLang export, held-out folds never share a prompt, and predicted τ (bench's metric and the
offline replay) matches what the rounds committed."""

from __future__ import annotations

import itertools
import json
import shutil
import warnings

import pytest
import torch
from tiny_models import assert_cli_error, run_cli, tiny_target

from dspec_cli.core.calibration import (
    Calibration,
    CalibrationRuleMismatch,
    RuleFit,
    apply_temperatures,
)
from dspec_cli.core.files import embedded_path
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.types import Capability, Proposal
from dspec_cli.runtime.drafter import Drafter, DrafterConfig
from dspec_cli.runtime.engine import GenerationConfig, RequestResult, SpeculativeEngine
from dspec_cli.runtime.schedule import (
    FixedScheduler,
    HardwareScheduler,
    ThresholdScheduler,
)
from dspec_cli.runtime.verify import verify_chain
from dspec_cli.workflows.calibrate import (
    Rounds,
    ece_floor,
    fit_rule,
    folds,
    heldout_metrics,
    position_metrics,
    save_traces,
)
from dspec_cli.workflows.metrics import predicted_tau
from dspec_cli.workflows.simulate import simulate_load

TOLERANCE = 0.01  # binned gap between fitted and exact survival the fit must stay within (docs/calibration.md)
N, GAMMA, VOCAB = 20_000, 4, 4
SHIPPED = embedded_path("drafters") / "dspark-markov"


def soft_ece(pred: torch.Tensor, exact: torch.Tensor, bins: int = 20) -> float:
    """ECE of survival predictions pred [N, γ] against the exact survival exact [N, γ] instead of
    0/1 outcomes (no sampling noise): Σ_bins |mean pred − mean exact| · count / total, all positions."""
    idx = (pred * bins).long().clamp(0, bins - 1) + bins * torch.arange(pred.shape[1])  # a bin per position
    count = torch.zeros(bins * pred.shape[1], dtype=torch.float64).index_add_(0, idx.flatten(), torch.ones(pred.numel(),
                                                                                                            dtype=torch.float64))
    gap = torch.zeros_like(count).index_add_(0, idx.flatten(), (pred - exact).flatten().double())
    return float(gap.abs().sum() / pred.numel()) if count.sum() else 0.0


@pytest.fixture(scope="module")
def verified():
    """Rounds of γ = 4 drafts from random q over 4 tokens against random p, verified by dspec's
    token and block rules; the confidence is the token rule's per-position acceptance
    c_k = 1 − TV(p_k, q_k) (the confidence head's training target, DSpark §3.2.1), and the exact
    survival P(τ ≥ k) is Π c under the token rule and E_q[ρ_k] under the block rule (every draft
    prefix enumerated). {rule: (raw rounds, exact survival [N, γ])}."""
    g = torch.Generator().manual_seed(0)
    scale = 1.5 * torch.rand(N, 1, 1, generator=g, dtype=torch.float64) + 0.3
    q = torch.softmax(scale * torch.randn(N, GAMMA, VOCAB, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(scale * torch.randn(N, GAMMA, VOCAB, generator=g, dtype=torch.float64) + q.log(), -1)
    c = (1 - 0.5 * (p - q).abs().sum(-1)).clamp(1e-6, 1 - 1e-6)  # [N, γ]
    x = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=g).reshape(N, GAMMA)
    rows = torch.cat([p, torch.full((N, 1, VOCAB), 1.0 / VOCAB, dtype=torch.float64)], 1).reshape(-1, VOCAB).float()
    combos = torch.tensor(list(itertools.product(range(VOCAB), repeat=GAMMA)))  # every draft block [V^γ, γ]
    ratio = p[:, torch.arange(GAMMA), combos] / q[:, torch.arange(GAMMA), combos]  # [N, V^γ, γ]
    weight = q[:, torch.arange(GAMMA), combos].cumprod(-1)  # Q(x_≤k)
    rho, block = torch.ones(N, combos.shape[0], dtype=torch.float64), []
    for k in range(GAMMA):  # ρ_k = min(1, ρ_{k−1} p/q); each x_≤k appears V^(γ−1−k) times
        rho = torch.minimum(rho * ratio[..., k], torch.ones_like(rho))
        block.append((rho * weight[..., k]).sum(1) / VOCAB ** (GAMMA - 1 - k))
    exact = {"token": c.cumprod(1), "block": torch.stack(block, 1)}
    out = {}
    for rule in ("token", "block"):
        acc = verify_chain(rows, x.reshape(-1), q.reshape(-1, VOCAB).float(), torch.full((N,), GAMMA), method=rule,
                           generator=g).accepted
        out[rule] = (Rounds(c, torch.full((N,), GAMMA), acc, torch.arange(N) // 50), exact[rule])
    return out


@pytest.fixture(scope="module")
def fits(verified):
    return {rule: fit_rule(rounds) for rule, (rounds, _) in verified.items()}


# --------------------------------------------------------------------------------------
# The survival map against the exact survival of each rule
# --------------------------------------------------------------------------------------


def test_the_survival_map_recovers_each_rules_exact_survival(verified, fits):
    for rule, (rounds, exact) in verified.items():
        fitted = rounds.calibrated(fits[rule]).confidence.cumprod(1)
        assert soft_ece(fitted, exact) < TOLERANCE, rule
    rounds, exact = verified["token"]
    assert soft_ece(rounds.confidence.cumprod(1), exact) < 1e-12  # the token rule's survival is the product of c*


def test_the_raw_product_sts_or_the_other_rules_fit_miss_the_block_rule(verified, fits):
    """The variant that must fail: the block rule keeps prefixes the token rule cuts, so the product
    of the per-position acceptances, the token rule's fit, and STS (temperatures, no offset)
    all miss its survival by more than the tolerance."""
    rounds, exact = verified["block"]
    assert soft_ece(rounds.confidence.cumprod(1), exact) > 3 * TOLERANCE
    assert soft_ece(rounds.calibrated(fits["token"]).confidence.cumprod(1), exact) > 3 * TOLERANCE
    assert soft_ece(apply_temperatures(rounds.confidence, fits["block"].temperatures).cumprod(1), exact) > TOLERANCE
    assert soft_ece(verified["token"][0].calibrated(fits["block"]).confidence.cumprod(1), verified["token"][1]) > 3 * TOLERANCE


def _prefix_stable(apply, conf: torch.Tensor, g: torch.Generator) -> bool:
    """Whether apply's output at positions 1..k ignores c_{k+1..} (redrawn for every k)."""
    base = apply(conf)
    for k in range(conf.shape[1] - 1):
        other = conf.clone()
        other[:, k + 1 :] = 0.05 + 0.9 * torch.rand(conf.shape[0], conf.shape[1] - k - 1, generator=g, dtype=torch.float64)
        if not torch.equal(apply(other)[:, : k + 1], base[:, : k + 1]):
            return False
    return True


def test_the_survival_map_is_non_anticipating_and_non_increasing(fits):
    """c'_k depends on c_1..c_k only (the schedulers stay lossless) and Π c' never rises; a map that
    peeks at the last position (the variant) is caught by the same check."""
    g = torch.Generator().manual_seed(1)
    conf = 0.05 + 0.9 * torch.rand(64, GAMMA, generator=g, dtype=torch.float64)
    assert _prefix_stable(fits["block"].apply, conf, g)
    assert not _prefix_stable(lambda c: fits["block"].apply(c) * c[:, -1:], conf, g)
    base = fits["block"].apply(conf)
    survival = base.cumprod(1)
    assert bool((survival[:, 1:] <= survival[:, :-1] + 1e-12).all()) and bool((base >= 0).all() & (base <= 1).all())


def test_the_ece_floor_is_what_perfect_calibration_shows(verified):
    """On rounds whose outcomes follow their predictions the ECE sits at the floor; off by a
    temperature it does not (the variant)."""
    rounds, exact = verified["token"]
    g = torch.Generator().manual_seed(3)
    sample = rounds.select(torch.arange(4000))
    u = torch.rand(4000, 1, generator=g, dtype=torch.float64)
    honest = Rounds(sample.confidence, sample.verified, (u < exact[:4000]).sum(1))
    floor = ece_floor(honest)
    assert 0 < floor < 0.03 and abs(position_metrics(honest)["ece_mean"] - floor) < 0.006
    off = honest.with_temperatures([0.6] * GAMMA)
    assert position_metrics(off)["ece_mean"] > floor + 0.02


# --------------------------------------------------------------------------------------
# Held-out folds
# --------------------------------------------------------------------------------------


def test_folds_never_split_a_prompt_and_score_each_round_by_the_other_folds(verified):
    rounds = verified["block"][0].select(torch.arange(3000))
    fold, split = folds(rounds)
    assert split == "5-fold over prompts" and set(fold.tolist()) == set(range(5))
    for prompt in torch.unique(rounds.prompt):
        assert len(set(fold[rounds.prompt == prompt].tolist())) == 1
    held = heldout_metrics(rounds)
    test = (fold == 0).nonzero().squeeze(1)
    other = fit_rule(rounds.select((fold != 0).nonzero().squeeze(1)))
    scored = rounds.select(test).calibrated(other)
    assert position_metrics(scored)["count"][0] == len(test)
    assert held["after"]["count"] == position_metrics(rounds)["count"]
    # the variant: without prompts, contiguous blocks of rounds (and the split says so)
    anonymous = Rounds(rounds.confidence, rounds.verified, rounds.accepted)
    fold, split = folds(anonymous)
    assert split.startswith("5 contiguous blocks") and torch.equal(fold, fold.sort().values)


# --------------------------------------------------------------------------------------
# Warnings and refusals under the other rule
# --------------------------------------------------------------------------------------


class _QDrafter(Drafter):
    """A drafter with draft probabilities (so chains take the configured rule), one-hot on its
    drafts, with a fixed raw confidence 0.7."""

    name = "test-q"
    capabilities = frozenset({Capability.draft_probs})

    def propose(self, state, anchors, max_len, sampler):
        R = anchors.shape[0]
        tokens = anchors[:, None].repeat(1, max_len)
        probs = torch.nn.functional.one_hot(tokens, self.target.vocab_size).float()
        return Proposal(tokens=tokens, lengths=torch.full((R,), max_len), draft_probs=probs,
                        confidence=torch.full((R, max_len), 0.7))


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_the_engine_warns_under_a_rule_the_calibration_has_no_fit_for(target):
    drafter = _QDrafter(DrafterConfig(block_size=3), target)
    drafter.calibration = Calibration.sts("test-q", 3, [1.0] * 3, "token", source="ckpt/calibration.json")
    with pytest.warns(CalibrationRuleMismatch, match=r"the calibration of drafter test-q \(ckpt/calibration.json\) was "
                      r"fitted under the token rule, but this run verifies by the block rule.*--verify block"):
        SpeculativeEngine(target, drafter, GenerationConfig(block_size=3, chain_verify="block"))
    with warnings.catch_warnings():  # the variants: the rule it was fitted under; greedy (both rules are matching)
        warnings.simplefilter("error", CalibrationRuleMismatch)
        SpeculativeEngine(target, drafter, GenerationConfig(block_size=3, chain_verify="token"))
        SpeculativeEngine(target, drafter, GenerationConfig(block_size=3, chain_verify="block", temperature=0))
    legacy = Calibration.sts("test-q", 3, [1.0] * 3, recorded_rule=False)  # a file that records no rule
    drafter.calibration = legacy
    with pytest.warns(CalibrationRuleMismatch, match="records no verification rule and is taken as the token rule's"):
        SpeculativeEngine(target, drafter, GenerationConfig(block_size=3, chain_verify="block"))


def test_the_engine_applies_the_fit_of_the_rule_that_verifies(target):
    """Per-rule temperatures reach the recorded (scheduler-side) confidences for the rule in use."""
    drafter = _QDrafter(DrafterConfig(block_size=3), target)
    fits = {"token": RuleFit([2.0, 2.0, 2.0]), "block": RuleFit([0.5, 0.5, 0.5])}
    drafter.calibration = Calibration("test-q", 3, fits)
    prompt = [target.render_prompt("The quick brown fox")]
    for rule, temp in (("token", 2.0), ("block", 0.5)):
        cfg = GenerationConfig(max_new_tokens=8, block_size=3, seed=0, chain_verify=rule)
        res = SpeculativeEngine(target, drafter, cfg).generate(prompt)[0]
        want = float(torch.sigmoid(torch.logit(torch.tensor(0.7, dtype=torch.float64)) / temp))
        full = [c for c in res.confidence if len(c) == 3]
        assert full and all(c == pytest.approx([want] * 3, abs=1e-6) for c in full), rule
        assert len(res.confidence) == len(res.verified)  # one list per round, [] for rounds without drafts


def _block_only_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SHIPPED, ckpt)
    cal = Calibration.load(ckpt)
    cal.with_fits({"block": cal.fits["block"]}).save(ckpt)
    return ckpt


def test_bench_export_and_schedule_under_the_other_rule(tmp_path, capsys):
    """bench warns in one line, the SGLang export refuses with the command to run, ``dspec
    schedule`` warns; with a fit for the rule (the shipped checkpoint has both) none of it."""
    ckpt = _block_only_checkpoint(tmp_path)
    bench = ["bench", "--drafter", "dspark", "--num-prompts", "1", "--max-new-tokens", "6", "--verify", "token"]
    mismatch = "was fitted under the block rule, but this run verifies by the token rule"
    code, _, err = run_cli([*bench, "--checkpoint", str(ckpt)], capsys)
    assert code == 0 and sum(mismatch in line for line in err.splitlines()) == 1, err
    code, _, err = run_cli(bench, capsys)
    assert code == 0 and "fitted under" not in err, err
    out = tmp_path / "sglang"
    assert_cli_error(["export", str(ckpt), "--format", "sglang", "--output", str(out)], capsys,
                     "has no fit for the token rule, which SGLang's DSpark verifies by (only block): fit it with "
                     "`dspec calibrate --drafter dspark-markov --checkpoint DIR --verify token --in-place`")
    assert not out.exists()
    table = tmp_path / "cost.json"
    _table([100.0, 90.0, 20.0], [1, 8, 64]).save(table)
    traces = tmp_path / "t.jsonl"
    save_traces(traces, Rounds.from_lists([[0.9, 0.5, 0.3]] * 20, [2] * 20, block_size=3), drafter="dspark-markov",
                block_size=3, verify="token")
    cal_3 = tmp_path / "cal.json"
    full = Calibration.load(SHIPPED)
    for fits, warns in (({"block": RuleFit([1.0] * 3)}, True), ({"token": RuleFit([1.0] * 3)}, False)):
        Calibration(full.drafter, 3, fits).save(cal_3)
        code, _, err = run_cli(["schedule", "--cost-table", str(table), "--traces", str(traces), "--calibration",
                                str(cal_3), "--concurrency", "1"], capsys)
        assert code == 0 and ("but this run verifies by the token rule" in err) == warns, err


# --------------------------------------------------------------------------------------
# Predicted τ: bench's metric and the offline replay
# --------------------------------------------------------------------------------------


def test_predicted_tau_of_engine_results():
    res = RequestResult(0, [1], verified=[2, 0, 1], accepted=[1, 0, 0], confidence=[[0.5, 0.5], [], [0.8]])
    got = predicted_tau([res])
    assert got["predicted_tau"] == pytest.approx((1.75 + 1.0 + 1.8) / 3)
    assert got["verifying_rounds"] == 2 and got["verifying_tau"] == pytest.approx(1.5)
    assert got["verifying_predicted_tau"] == pytest.approx((1.75 + 1.8) / 2)
    misaligned = RequestResult(0, [1], verified=[2, 0], accepted=[1, 0], confidence=[[0.5, 0.5]])  # the variant
    assert predicted_tau([misaligned])["predicted_tau"] is None


def _table(sps: list[float], grid: list[int]) -> CostTable:
    return CostTable(device="cpu", device_name="cpu", dtype="float32", model="toy", torch=torch.__version__, grid=grid,
                     contexts=[128], measured={"128": sps})


CURVE = _table([100.0 / (1 + 0.1 * (b - 1)) for b in range(1, 300)], list(range(1, 300)))  # every token costs


def test_the_replays_fixed_tau_is_the_traces_own(verified):
    rounds = verified["block"][0].select(torch.arange(999))
    recorded = 1 + float(rounds.accepted.double().mean())
    for R in (1, 16):  # one pass: every record once, the last batch holds what is left
        fixed = simulate_load(FixedScheduler(), rounds, CURVE, concurrency=R, generator=torch.Generator().manual_seed(R))
        assert fixed["tau"] == pytest.approx(recorded, abs=1e-12)
    cut = simulate_load(ThresholdScheduler(threshold=0.6), rounds, CURVE, concurrency=4)  # the variant: ℓ < γ
    assert cut["tau"] < recorded - 0.1


@pytest.mark.parametrize("rule", ["token", "block"])
def test_predicted_tau_holds_within_5_percent_under_each_rule(verified, fits, rule):
    """The hardware scheduler at R = 1 and 16 on rounds it was not fitted on: pred. τ within 5 %
    of τ with the rule's own fit; the variant, the other rule's fit, misses by more."""
    rounds = verified[rule][0]
    train, test = rounds.select(torch.arange(0, N, 2)), rounds.select(torch.arange(1, N // 3, 2))
    own = fit_rule(train)
    for R in (1, 16):
        res = simulate_load(HardwareScheduler(CURVE, gate=False), test.calibrated(own), CURVE, concurrency=R,
                            generator=torch.Generator().manual_seed(R), layout="padded")
        assert 0 < res["mean_draft_len"] < GAMMA, res  # the scheduler trims: ℓ is chosen from the numbers
        assert abs(res["predicted_tau"] / res["tau"] - 1) < 0.05, (rule, R, res)
    other = fits["block" if rule == "token" else "token"]
    res = simulate_load(HardwareScheduler(CURVE, gate=False), test.calibrated(other), CURVE, concurrency=1,
                        generator=torch.Generator().manual_seed(1), layout="padded")
    assert abs(res["predicted_tau"] / res["tau"] - 1) > 0.05, res


def test_schedule_reports_the_traces_tau_and_rule(verified, tmp_path, capsys):
    traces = tmp_path / "t.jsonl"
    rounds = verified["block"][0].select(torch.arange(500))
    save_traces(traces, rounds, drafter="dspark-markov", block_size=GAMMA, verify="block")
    table = tmp_path / "cost.json"
    CURVE.save(table)
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(["schedule", "--cost-table", str(table), "--traces", str(traces), "-s", "fixed",
                                 "--concurrency", "1,8", "--json", str(out)], capsys)
    assert code == 0 and "block rule" in stdout, err
    report = json.loads(out.read_text())
    assert report["verify"] == "block" and all(r["tau"] == pytest.approx(report["trace_tau"]) for r in report["results"])
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(traces.read_text() + traces.read_text().replace('"verify": "block"', '"verify": "token"'))
    assert_cli_error(["schedule", "--cost-table", str(table), "--traces", str(mixed)], capsys,
                     "verify 'token' differs from earlier lines ('block'): rounds verified by different rules do not mix")
