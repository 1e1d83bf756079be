"""``dspark-markov`` / ``dspark-rnn``: heads, confidence, losslessness, training, calibration."""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash import (
    SAMPLINGS,
    build,
    check_draft_probs,
    check_greedy,
    check_lossless,
    check_training,
    training_batch,
)
from tiny_models import full_forward, tiny_target

from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class

NAMES = ["dspark-markov", "dspark-rnn"]


class ForcedSampler:
    """q = softmax(logits) (T = 1); the drawn tokens are fixed in advance: tokens [R, γ]."""

    greedy = False

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def probs(self, logits):
        return torch.softmax(logits.float(), dim=-1)

    def sample(self, probs, step):
        return self.tokens[:, step]


def strong(drafter):
    """Random heads with a bias as large as the base logits, so a wrong q_k would show."""
    with torch.no_grad():
        drafter.net.head.proj.weight.mul_(10.0)
    return drafter


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=0)


def _state_after_prompt(target, drafter, text: str):
    prompt = torch.tensor(target.render_prompt(text))
    _, taps = full_forward(target, prompt[None], drafter.target_layer_ids)
    state = drafter.init_state()
    drafter.add_requests(state, [prompt], [taps])
    return state


def test_registered():
    from dspec_dspark import DSparkMarkovDrafter, DSparkRNNDrafter

    assert get_drafter_class("dspark") is get_drafter_class("dspark-markov") is DSparkMarkovDrafter
    assert get_drafter_class("dspark-rnn") is DSparkRNNDrafter
    assert "confidence" in DSparkRNNDrafter.capabilities
    cfg = DSparkMarkovDrafter.config_class()
    assert (cfg.head, cfg.markov_rank, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight) == ("markov", 256, 0.1, 0.9, 1.0)
    assert DSparkRNNDrafter.config_class().head == "rnn"
    with pytest.raises(DspecError, match="markov_rank"):
        DSparkMarkovDrafter.config_class(markov_rank=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain_greedy(target, name):
    check_greedy(target, build(name, target))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lossless_quick(target, name, sampling):
    check_lossless(target, build(name, target), sampling, num_prompts=1, per_prompt=4000)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lossless_end_to_end(target, name, sampling):
    check_lossless(target, build(name, target), sampling, num_prompts=3, per_prompt=8000)


@pytest.mark.parametrize("name", NAMES)
def test_draft_probs_are_the_sampling_distribution(target, name):
    check_draft_probs(target, strong(build(name, target)))


@pytest.mark.parametrize("name", NAMES)
def test_training_loss(target, name):
    out = check_training(target, build(name, target))
    assert out["conf"] > 0 and out["l1"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_inference_matches_teacher_forced_training(target, name):
    """Sampling the true continuation at inference gives the training forward's q_k and c_k."""
    drafter = build(name, target)
    batch, feats = training_batch(target, drafter.target_layer_ids)
    ids, a, gamma = batch["input_ids"][:1], 9, drafter.config.block_size
    out = drafter.block_outputs(
        {"input_ids": ids, "loss_mask": torch.ones_like(ids)},
        {k: v[:1] for k, v in feats.items()}, torch.tensor([[a]]), torch.tensor([[True]]),
    )
    state = drafter.init_state()
    drafter.add_requests(state, [ids[0, :a]], [feats["taps"][0, :a]])
    prop = drafter.propose(state, ids[0, a : a + 1], gamma, ForcedSampler(ids[:, a + 1 : a + 1 + gamma]))
    torch.testing.assert_close(prop.draft_probs[0], torch.softmax(out.logits, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(prop.confidence[0], torch.sigmoid(out.conf_logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_confidence_is_non_anticipating(target, name):
    """c_k uses h_k and x_{k−1}: changing x_k leaves c_1..c_k alone and moves c_{k+1}."""
    drafter = build(name, target)
    state = _state_after_prompt(target, drafter, "The quick brown fox")
    anchors = torch.tensor([17])
    forced = torch.tensor([[40, 41, 42, 43]])
    base = drafter.propose(state, anchors, 4, ForcedSampler(forced))
    assert base.confidence.shape == (1, 4) and ((base.confidence > 0) & (base.confidence < 1)).all()
    for k in range(3):
        changed = forced.clone()
        changed[0, k] = 99
        other = drafter.propose(state, anchors, 4, ForcedSampler(changed))
        assert torch.equal(other.confidence[:, : k + 1], base.confidence[:, : k + 1])
        assert not torch.allclose(other.confidence[:, k + 1], base.confidence[:, k + 1])
        assert torch.equal(other.draft_probs[:, : k + 1], base.draft_probs[:, : k + 1])


def test_rnn_remembers_more_than_one_token(target):
    """The RNN bias at slot 2 depends on x_0 (via its state); the Markov bias does not."""
    for name, depends in (("dspark-rnn", True), ("dspark-markov", False)):
        drafter = build(name, target)
        state = _state_after_prompt(target, drafter, "The quick brown fox")
        a = drafter.propose(state, torch.tensor([17]), 3, ForcedSampler(torch.tensor([[40, 41, 42]])))
        b = drafter.propose(state, torch.tensor([17]), 3, ForcedSampler(torch.tensor([[50, 41, 42]])))
        assert torch.allclose(a.draft_probs[:, 2], b.draft_probs[:, 2]) != depends


def test_calibration_round_trip(target, tmp_path):
    drafter = build("dspark-markov", target)
    state = _state_after_prompt(target, drafter, "Numbers like 0 1 2")
    sampler = ForcedSampler(torch.tensor([[40, 41, 42, 43]]))
    raw = drafter.propose(state, torch.tensor([17]), 4, sampler).confidence
    drafter.save_pretrained(tmp_path)
    temps = [2.0, 0.5]
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": temps}))
    loaded = type(drafter).from_pretrained(tmp_path, target)
    proposed = loaded.propose(_state_after_prompt(target, loaded, "Numbers like 0 1 2"), torch.tensor([17]), 4, sampler)
    torch.testing.assert_close(proposed.confidence, raw)  # drafters report raw confidences ...
    cal = loaded.calibration.apply(proposed.confidence)  # ... and the engine applies the checkpoint's STS
    logit = torch.logit(raw.double())
    want = torch.sigmoid(logit / torch.tensor([2.0, 0.5, 1.0, 1.0], dtype=torch.float64)).float()
    torch.testing.assert_close(cal, want, atol=1e-5, rtol=0)
    loaded.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "calibration.json").read_text())  # rewritten with its rule: token
    assert again["rules"]["token"]["temperatures"] == temps
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.0, -1.0]}))
    with pytest.raises(DspecError, match="calibration.json"):
        type(drafter).from_pretrained(tmp_path, target)


def test_markov_transition_table_is_the_low_rank_bias():
    """On a CPU the decoding bias is a row of W1·W2; it follows weight updates and is not used under grad."""
    from dspec_cli.nn.heads import TABLE_MAX_BYTES, MarkovHead

    torch.manual_seed(0)
    head = MarkovHead(64, 8, 16)
    prev = torch.tensor([[3, 9], [0, 63]])
    with torch.no_grad():
        table = head.transition_table()
        assert table is not None and table.shape == (64, 64)
        bias, state = head.step_bias(None, prev, torch.zeros(2, 2, 16))
        assert state is None and bias.shape == (2, 2, 64)
        torch.testing.assert_close(bias, head.proj(head.embed(prev)))
        head.proj.weight.mul_(2.0)  # an in-place update (optimizer step) invalidates the table
        torch.testing.assert_close(head.step_bias(None, prev, None)[0], head.proj(head.embed(prev)))
    assert head.transition_table() is None  # training: gradients flow through W1 and W2
    big = MarkovHead(int((TABLE_MAX_BYTES // 4) ** 0.5) + 1, 1, 4)
    with torch.no_grad():
        assert big.transition_table() is None  # too large to cache: the matrix-vector product


def test_each_drafter_has_its_own_head_and_proposer():
    """dflash draws its slots independently and has no sequential head; DSpark's proposer (its
    own module) draws through a Markov or RNN head."""
    from dspec_dspark.drafter import DSparkDrafter

    with pytest.raises(DspecError, match="dflash has no sequential head"):
        get_drafter_class("dflash").config_class(head="markov", markov_rank=8)
    with pytest.raises(DspecError, match="markov or rnn"):
        get_drafter_class("dspark-markov").config_class(head="none")
    for name in NAMES:
        assert get_drafter_class(name).propose is DSparkDrafter.propose
    assert get_drafter_class("dflash").propose is not DSparkDrafter.propose
