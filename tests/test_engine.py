"""The batched speculative engine: greedy identity, batch invariance, end-to-end losslessness."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3, tiny_target, tiny_tokenizer

from dspec_cli.checkpoints.config import DrafterConfig
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.drafter import Drafter
from dspec_cli.runtime.engine import GenerationConfig, RoundSampler, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.testing import (
    assert_continuations_match,
    check_engine_lossless,
    exact_continuations,
    results_by_concurrency,
)
from dspec_cli.workflows.metrics import acceptance

PROMPTS = ["Speculative decoding drafts", "The quick brown fox", "Numbers like 0 1 2", "def add(a, b):"]


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


def make_drafter(name: str, target: Target, block_size: int = 4, draft_seed: int | None = 1):
    cls = get_drafter_class(name)
    cfg = cls.config_class(block_size=block_size)
    if name == "draft-model":
        model = target if draft_seed is None else Target(tiny_qwen3(seed=draft_seed), tiny_tokenizer())
        return cls(cfg, target, model=model)
    return cls.build(cfg, target)


def plain_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model", None])
def test_greedy_equals_plain_greedy(target, name):
    prompts = [target.render_prompt(p) for p in PROMPTS]
    drafter = make_drafter(name, target) if name else None
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, block_size=4, max_batch=3)
    results = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == plain_greedy(target, prompt, 20)
        assert res.finish_reason == "length"


def test_self_draft_accepts_everything(target):
    """The target as its own draft model: under greedy every draft is accepted, τ = γ + 1."""
    prompts = [target.render_prompt(p) for p in PROMPTS]
    drafter = make_drafter("draft-model", target, block_size=4, draft_seed=None)
    cfg = GenerationConfig(max_new_tokens=1 + 5 * 4, temperature=0.0, block_size=4, max_batch=4)
    results = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)
    stats = acceptance(results, 4)
    assert stats["tau"] == pytest.approx(5.0)
    assert all(a == 4 for r in results for a in r.accepted)


@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model"])
def test_continuous_batching_is_batch_invariant(target, name):
    """Per-request counter-based randomness: the same seeds give the same tokens at any concurrency."""
    prompts = [target.render_prompt(p) for p in PROMPTS] * 2
    drafter = make_drafter(name, target)
    runs = results_by_concurrency(target, drafter, prompts, (1, 3, 8), max_new_tokens=12, temperature=1.0,
                                  block_size=4, seed=5)
    outs = [[r.output_ids for r in results] for results in runs]
    assert outs[0] == outs[1] == outs[2]


def test_stop_tokens_and_budget(target):
    prompts = [target.render_prompt(p) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=15, temperature=1.0, block_size=4, max_batch=2, seed=3)
    free = SpeculativeEngine(target, make_drafter("prompt-lookup", target), cfg, stop_ids=[]).generate(prompts)
    stop = free[0].output_ids[5]
    stopped = SpeculativeEngine(target, make_drafter("prompt-lookup", target), cfg, stop_ids=[stop]).generate(prompts)
    for a, b in zip(free, stopped, strict=True):
        assert len(a.output_ids) == 15
        if stop in a.output_ids:
            cut = a.output_ids.index(stop) + 1
            assert b.output_ids == a.output_ids[:cut] and b.finish_reason == "stop"
        else:
            assert b.output_ids == a.output_ids


def test_bad_input(target):
    eng = SpeculativeEngine(target, None, GenerationConfig(max_new_tokens=4))
    with pytest.raises(DspecError, match="prompt 0 is empty"):
        eng.generate([[]])
    with pytest.raises(DspecError, match="exceeds the target's context"):
        eng.generate([[1] * 300])
    for bad in (0, -1):  # one rule wherever a block size is given (core.specs.check_block_size)
        with pytest.raises(DspecError, match="--block-size must be >= 1"):
            GenerationConfig(block_size=bad)


T1, T07 = dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)


# prompt lookup has no draft probabilities: it takes the token rule whatever is asked; the last
# case verifies with batch invariance off (fused attention: the same law, other roundings)
@pytest.mark.parametrize("name,rule,sampling,invariant", [
    ("prompt-lookup", "block", T1, None), ("prompt-lookup", "block", T07, None), ("draft-model", "block", T1, None),
    ("draft-model", "block", T07, None), ("draft-model", "token", T1, None), ("draft-model", "block", T1, False)])
def test_lossless_end_to_end(target, name, rule, sampling, invariant):
    """3-token continuations from the engine match exact target sampling (chi-square, 24k samples)."""
    prompts = [target.render_prompt(p) for p in PROMPTS[:3]]
    drafter = make_drafter(name, target, block_size=3)
    # 4 new tokens: round 1 verifies up to 2 drafts, so tokens 2-3 exercise draft positions 1-2
    results = check_engine_lossless(target, drafter, prompts, per_prompt=8000, max_batch=4000, sampling=sampling,
                                    name=f"{name} {rule}", verify=dict(chain_verify=rule, batch_invariant=invariant))
    assert sum(sum(r.verified) for r in results) > 0  # drafts were really verified


class BigramTreeDrafter(Drafter):
    """Test drafter: a fixed tree per anchor from the target's own next-token ranking given only
    the previous token (depth 2: 3 children, 2 grandchildren each). Deterministic, so the
    sample-and-match walk must reproduce exact target sampling."""

    name = "test-bigram-tree"
    target_layer_ids = ()

    def __init__(self, target: Target, width=(3, 2)):
        with torch.no_grad():
            logits = target.model(input_ids=torch.arange(target.vocab_size)[:, None]).logits[:, -1]
        self.top = logits.topk(max(width), -1).indices  # [V, k]
        self.width = width

    def init_state(self):
        from dspec_cli.runtime.drafter import DraftState

        return DraftState()

    def add_requests(self, state, prompts, hidden):
        state.context.extend(prompts)

    def remove_requests(self, state, keep):
        state.context = [state.context[i] for i in keep]

    def advance(self, state, committed, counts, hidden):
        pass

    def confidence(self, state, proposal):
        return None

    def propose(self, state, anchors, max_len, sampler):
        from dspec_cli.core.types import DraftTree, Proposal

        R = anchors.shape[0]
        w1, w2 = self.width
        kids = self.top[anchors, :w1]  # [R, w1]
        grand = self.top[kids, :w2].reshape(R, w1 * w2)  # [R, w1*w2]
        tokens = torch.cat([kids, grand], 1)
        parents = torch.cat([torch.zeros(R, w1, dtype=torch.long),
                             torch.arange(1, w1 + 1).repeat_interleave(w2).expand(R, -1)], 1)
        n = tokens.shape[1]
        tree = DraftTree(tokens=tokens, parents=parents, num_nodes=torch.full((R,), n))
        chain = torch.stack([kids[:, 0], grand[:, 0]], 1)
        return Proposal(tokens=chain, lengths=torch.full((R,), 2), tree=tree)


def test_tree_greedy_equals_plain_greedy(target):
    prompts = [target.render_prompt(p) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, block_size=2, max_batch=3)
    results = SpeculativeEngine(target, BigramTreeDrafter(target), cfg, stop_ids=[]).generate(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == plain_greedy(target, prompt, 20)
    assert sum(a for r in results for a in r.accepted) > 0  # some tree nodes were accepted


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_tree_lossless_end_to_end(target, sampling):
    """Batched ragged tree verification in the engine: 3-token continuations are exact."""
    prompts = [target.render_prompt(p) for p in PROMPTS[:2]]
    per_prompt = 8000
    cfg = GenerationConfig(max_new_tokens=4, block_size=2, max_batch=4000, seed=13, **sampling)
    engine = SpeculativeEngine(target, BigramTreeDrafter(target), cfg, stop_ids=[])
    for i, prompt in enumerate(prompts):
        results = engine.generate([prompt] * per_prompt, seeds=[i * 10**6 + s for s in range(per_prompt)])
        samples = torch.tensor([r.output_ids[:3] for r in results])
        exact = exact_continuations(target, prompt, depth=3, min_prob=2e-4, **sampling)
        assert_continuations_match(samples, exact, name=f"tree prompt {i} {sampling}")
        assert sum(a for r in results for a in r.accepted) > 0


@pytest.mark.parametrize("rule", ["token", "block"])
def test_end_to_end_test_catches_a_biased_verifier(target, rule, monkeypatch):
    """The same end-to-end check must fail when the verifier is wrong (token: min(1, q/p); block:
    the final token drawn from p instead of the residual)."""
    from dspec_cli.runtime.verify import block, reference

    if rule == "token":
        monkeypatch.setattr(reference, "acceptance_prob", lambda p_x, q_x: torch.clamp(q_x / p_x.clamp_min(1e-30), max=1.0))
    else:
        monkeypatch.setattr(block, "residual_weights", lambda p, q, rho: p.float())
    prompt = target.render_prompt(PROMPTS[0])
    drafter = make_drafter("draft-model", target, block_size=3)
    n = 8000 if rule == "token" else 16000  # the block bias is subtler on this pair of models
    cfg = GenerationConfig(max_new_tokens=4, block_size=3, max_batch=4000, seed=11, chain_verify=rule)
    results = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([prompt] * n, seeds=range(n))
    samples = torch.tensor([r.output_ids[:3] for r in results])
    exact = exact_continuations(target, prompt, depth=3, min_prob=2e-4)
    with pytest.raises(AssertionError, match="distribution mismatch"):
        assert_continuations_match(samples, exact, name="biased")


def test_drafts_without_probabilities_take_the_token_rule(target):
    """Prompt lookup proposes no q: block verification (the default) falls back to the token rule,
    which accepts the same for one-hot drafts; T = 0 is greedy verification."""
    prompt = target.render_prompt("one two three four one two three four one two three four one two three")
    drafter = make_drafter("prompt-lookup", target, block_size=3)
    for temperature, rule in ((1.0, "token"), (0.0, "greedy")):
        cfg = GenerationConfig(max_new_tokens=16, block_size=3, temperature=temperature)
        engine = SpeculativeEngine(target, drafter, cfg, stop_ids=[])
        engine.generate([prompt] * 4)
        assert set(engine.stats.verify_rules) == {rule}


def test_bad_verify_rules():
    with pytest.raises(DspecError, match="chains are verified by token or block, got 'traversal'"):
        GenerationConfig(chain_verify="traversal")
    with pytest.raises(DspecError, match="sampled trees are verified by sampled or traversal, got 'block'"):
        GenerationConfig(tree_verify="block")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_round_sampler_block_draws_match_single_draws(temperature):
    """sample(probs [R, n, V], step) gives the tokens of n calls sample(probs[:, k], step + k)
    (DFlash draws its independent slots at once), from a fresh sampler or a used one."""
    R, n, V = 3, 5, 50
    seeds, rounds = torch.tensor([1, 2, 3]), torch.tensor([4, 9, 1])
    cfg = GenerationConfig(temperature=temperature)
    probs = torch.softmax(torch.randn(R, n + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    single = RoundSampler(cfg, seeds, rounds, n + 1)
    expect = torch.stack([single.sample(probs[:, k], k) for k in range(n + 1)], 1)
    assert torch.equal(RoundSampler(cfg, seeds, rounds, n).sample(probs[:, 1:], 1), expect[:, 1:])
    used = RoundSampler(cfg, seeds, rounds, 2)
    used.sample(probs[:, 0], 0)  # uniforms for 2 steps exist; the block needs 6
    assert torch.equal(used.sample(probs, 0), expect)
    if temperature:
        assert not torch.equal(RoundSampler(cfg, seeds + 1, rounds, n).sample(probs, 0), expect)


class _FixedConfidenceDrafter(Drafter):
    """Drafts the anchor repeated with a raw confidence of 0.7 at every position."""

    name = "test-fixed-confidence"

    def propose(self, state, anchors, max_len, sampler):
        R = anchors.shape[0]
        return Proposal(tokens=anchors[:, None].repeat(1, max_len), lengths=torch.full((R,), max_len),
                        confidence=torch.full((R, max_len), 0.7))


def test_engine_applies_the_drafter_calibration_once(target):
    """The checkpoint's STS temperatures reach the scheduler (and the recorded rounds) exactly once."""
    drafter = _FixedConfidenceDrafter(DrafterConfig(block_size=3), target)
    drafter.calibration = Calibration.sts("test-fixed-confidence", 3, [2.0, 0.5, 1.0])  # one-hot drafts: the token rule
    cfg = GenerationConfig(max_new_tokens=8, block_size=3, seed=0)
    results = SpeculativeEngine(target, drafter, cfg).generate([target.render_prompt(PROMPTS[0])])
    raw = torch.full((1, 3), 0.7, dtype=torch.float64)
    want = torch.sigmoid(torch.logit(raw) / torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64))[0]
    rounds = [c for c in results[0].confidence if len(c) == 3]
    assert rounds, "no round verified the whole block"
    for conf in rounds:
        assert torch.allclose(torch.tensor(conf, dtype=torch.float64), want, atol=1e-6)
