"""``dflash``: engine identity and losslessness, training loss, checkpoints and their errors.

Helpers here are shared with test_dspark.py (a random drafter is enough: losslessness must
hold for any drafter)."""

from __future__ import annotations

import json

import pytest
import torch
from dspec_dflash.loss import block_losses
from tiny_models import full_forward, tiny_target, tiny_tokenizer, training_batch
from transformers import AutoModelForCausalLM, Qwen3Config

from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.sampling import logits_to_probs
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.testing import check_engine_lossless, chi_square_gof

PROMPTS = ["Speculative decoding drafts", "The quick brown fox", "Numbers like 0 1 2"]
SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Speculative decoding drafts several tokens with a small model and verifies them.",
]


def build(name: str, target: Target, seed: int = 1, **overrides):
    """A random drafter: 2 layers, γ = 4 (rank 16 heads), seeded."""
    cls = get_drafter_class(name)
    values = dict(block_size=4, num_layers=2, num_anchors=16)
    if name != "dflash":
        values["markov_rank"] = 16
    torch.manual_seed(seed)
    return cls.build(cls.config_class(**{**values, **overrides}), target)


def plain_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def check_greedy(target: Target, drafter) -> None:
    prompts = [target.render_prompt(p) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, block_size=4, max_batch=2)
    results = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == plain_greedy(target, prompt, 20)
    assert sum(sum(r.verified) for r in results) > 0


def check_lossless(target: Target, drafter, sampling: dict, num_prompts: int, per_prompt: int) -> None:
    """3-token continuations from the engine match exact target sampling (chi-square)."""
    prompts = [target.render_prompt(p) for p in PROMPTS[:num_prompts]]
    results = check_engine_lossless(target, drafter, prompts, per_prompt=per_prompt, sampling=sampling, name=drafter.name)
    assert sum(sum(r.verified) for r in results) > 0


class SeededSampler:
    """The run's sampling settings with torch-seeded draws."""

    def __init__(self, seed: int, **sampling):
        self.sampling, self.gen = sampling, torch.Generator().manual_seed(seed)
        self.greedy = sampling.get("temperature", 1.0) == 0

    def probs(self, logits):
        return logits_to_probs(logits, **self.sampling)

    def sample(self, probs, step):
        return torch.multinomial(probs.flatten(0, -2), 1, generator=self.gen).view(probs.shape[:-1])


def check_draft_probs(target: Target, drafter, rows: int = 4000) -> None:
    """Each x_k is drawn from the reported q_k: over many rows with one context, the counts of
    x_k match Σ_r q_k^(r) (chi-square). Slot k > 0 q's depend on the sampled prefix (heads)."""
    prompt = torch.tensor(target.render_prompt("The quick brown fox"))
    _, taps = full_forward(target, prompt[None], drafter.target_layer_ids)
    state = drafter.init_state()
    drafter.add_requests(state, [prompt] * rows, [taps] * rows)
    sampling = dict(temperature=0.7, top_p=0.9)
    prop = drafter.propose(state, torch.full((rows,), 17), 3, SeededSampler(0, **sampling))
    V = prop.draft_probs.shape[-1]
    for k in range(3):
        observed = torch.bincount(prop.tokens[:, k], minlength=V)
        _, _, p_value = chi_square_gof(observed.numpy(), prop.draft_probs[:, k].double().mean(0).numpy())
        assert p_value > 1e-4, f"slot {k}: tokens are not drawn from draft_probs (p = {p_value:.2e})"




def check_training(target: Target, drafter, steps: int = 6) -> dict:
    """Finite loss, gradients only for the drafter, and a few AdamW steps reduce the loss."""
    batch, feats = training_batch(target, drafter.target_layer_ids)
    out = drafter.training_loss(batch, feats, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out["loss"])
    assert out["tokens"] > 0 and 1.0 <= out["tau_probabilistic"] <= 1 + drafter.config.block_size
    assert all(0.0 <= out[f"accept_rate@{k}"] <= 1.0 for k in range(1, drafter.config.block_size + 1))
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = drafter.training_loss(batch, feats, generator=torch.Generator().manual_seed(0))["loss"]
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.trainable_parameters())
    assert losses[-1] < losses[0]
    return out


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


def test_registered():
    from dspec_dflash import DFlashDrafter

    assert get_drafter_class("dflash") is DFlashDrafter
    assert {"draft_probs", "marginals", "trainable"} <= DFlashDrafter.capabilities


def test_greedy_equals_plain_greedy(target):
    check_greedy(target, build("dflash", target))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lossless_quick(target, sampling):
    check_lossless(target, build("dflash", target), sampling, num_prompts=1, per_prompt=4000)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lossless_end_to_end(target, sampling):
    check_lossless(target, build("dflash", target), sampling, num_prompts=3, per_prompt=8000)


def test_draft_probs_are_the_sampling_distribution(target):
    check_draft_probs(target, build("dflash", target))


def test_proposal_shapes(target):
    drafter = build("dflash", target)
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.0, block_size=6, max_batch=2)
    results = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([target.render_prompt("hi")] * 2)
    assert all(p <= 4 for r in results for p in r.proposed)  # γ = the drafter's block size


def test_training_loss(target):
    out = check_training(target, build("dflash", target))
    assert out["conf"] == 0.0 and out["l1"] > 0


def test_block_losses_by_hand():
    V = 5
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    target_logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    labels, slots = torch.tensor([1, 2, 0]), torch.tensor([0, 1, 0])
    conf = torch.tensor([0.3, -0.2, 1.0])
    out = block_losses(logits, target_logits, labels, slots, conf, block_size=2, ce_weight=0.1,
                       l1_weight=0.9, conf_weight=1.0, decay_gamma=4.0)
    w = torch.exp(-slots.float() / 4.0)
    ce = -torch.log_softmax(logits, -1)[torch.arange(3), labels]
    l1 = (torch.softmax(logits, -1) - torch.softmax(target_logits, -1)).abs().sum(-1)
    c = 1 - l1 / 2
    bce = -(c * torch.log(torch.sigmoid(conf)) + (1 - c) * torch.log(1 - torch.sigmoid(conf)))
    want = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    torch.testing.assert_close(out["loss"], want)
    assert out["accept_rate@1"] == pytest.approx(float(c[[0, 2]].mean()))
    assert out["tau_probabilistic"] == pytest.approx(float(1 + c[[0, 2]].mean() + c[[0, 2]].mean() * c[1]))


def test_mask_token_choice(target):
    drafter = build("dflash", target)
    assert drafter.config.mask_token_id == target.tokenizer.pad_token_id  # tokenizer full, no <|mask|>
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|mask|>"]})
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(**{**target.config.to_dict(), "vocab_size": 400}), attn_implementation="sdpa"
    )
    assert build("dflash", Target(model, tok)).config.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")


def test_save_load_round_trip(target, tmp_path):
    drafter = build("dflash", target)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["drafter"] == "dflash" and saved["drafter_config"]["hidden_size"] == 64
    from safetensors.torch import load_file

    assert not any("embed" in k or "lm_head" in k for k in load_file(str(tmp_path / "model.safetensors")))
    loaded = type(drafter).from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    state = drafter.init_state(), loaded.init_state()
    prompt = torch.tensor(target.render_prompt("hello"))
    _, taps = full_forward(target, prompt[None], drafter.target_layer_ids)
    for d, s in zip((drafter, loaded), state, strict=True):
        d.add_requests(s, [prompt], [taps])
    anchors = torch.tensor([5])
    torch.testing.assert_close(drafter.block_logits(state[0], anchors), loaded.block_logits(state[1], anchors))


def _other_target(**changes) -> Target:
    cfg = Qwen3Config(**{**tiny_target().config.to_dict(), **changes})
    return Target(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), tiny_tokenizer())


def test_checkpoint_mismatch_errors(target, tmp_path):
    drafter = build("dflash", target)
    drafter.save_pretrained(tmp_path)
    cls = type(drafter)
    with pytest.raises(DspecError, match="hidden size 64 does not match the target's 32"):
        cls.from_pretrained(tmp_path, _other_target(hidden_size=32, head_dim=8))
    with pytest.raises(DspecError, match="vocabulary size 384 does not match the target's 400"):
        cls.from_pretrained(tmp_path, _other_target(vocab_size=400))
    with pytest.raises(DspecError, match="holds a 'dflash' drafter, not 'dspark-markov'"):
        get_drafter_class("dspark").from_pretrained(tmp_path, target)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["drafter_config"]["intermediate_size"] = 96  # weights no longer fit the architecture
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DspecError, match="weights do not fit") as err:
        cls.from_pretrained(tmp_path, target)
    assert "\n" not in str(err.value)
    with pytest.raises(DspecError, match="target_layer_ids"):
        build("dflash", target, target_layer_ids=(0, 3))


def test_load_default(target, tmp_path, monkeypatch):

    monkeypatch.setattr("dspec_cli.checkpoints.persist.embedded_path", lambda name: tmp_path / name)
    cls = get_drafter_class("dflash")
    with pytest.raises(DspecError, match="no trained dflash drafter is embedded; train one with `dspec train --drafter dflash"):
        cls.load_default(target)
    build("dflash", target).save_pretrained(tmp_path / "drafters" / "dflash")
    assert isinstance(cls.load_default(target), cls)
    with pytest.raises(DspecError, match="does not fit this target .*--checkpoint"):
        cls.load_default(_other_target(vocab_size=400))
