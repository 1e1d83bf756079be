"""Batch-invariant verification on a CPU (runtime/decoder.py): in bfloat16 a token's logits in a
verify of ℓ + 1 tokens equal a one-token step's bit for bit, at contexts whose windows cross
the vector width and torch's 512-slot attention blocks; with the setting off (PyTorch's fused
attention in place of the decoder's: the variant that must fail) they do not. The end-to-end
consequence, greedy output identical with every drafter, is tested in test_embedded_target.py;
the setting's default rule and its refusal where it cannot apply here."""

from __future__ import annotations

import pytest
import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import cpu_native_half
from dspec_cli.runtime.decoder import WINDOW_MULTIPLE, LeanDecoder
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target

BF16 = pytest.mark.skipif(not cpu_native_half(torch.bfloat16),
                          reason="bit-level invariance is checked where the CPU multiplies bfloat16 natively")

CONTEXTS = (5, 11, 250, 505, 509, 700)  # windows below, across and past a 16-slot vector and 512-slot block
WIDTH = 8  # tokens per verify: an anchor and γ = 7 drafts


@pytest.fixture(scope="module")
def target() -> Target:
    target = Target.load(None, dtype="bfloat16")
    assert target.lean, "the embedded target (Qwen3) runs dspec's own forward on a CPU"
    return target


def _same_logits(target: Target, context: int, seed: int, invariant: bool = True) -> bool:
    """Whether WIDTH one-token steps after ``context`` random tokens give the logits, bit for
    bit, of one verify of the same WIDTH tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(target.vocab_size, (context + WIDTH,), generator=gen)
    batch = target.new_batch(rows=1, slots=context + 2 * WIDTH + 32, batch_invariant=invariant)
    target.prefill(batch, [tokens[:context].tolist()])
    new = tokens[None, context:]
    verify, _ = target.score(batch, new, None, batch.window(WIDTH))  # [1, WIDTH, V]; commits nothing
    steps = []
    for j in range(WIDTH):
        logits, _ = target.score(batch, new[:, j : j + 1], None, batch.window(1))
        steps.append(logits[:, 0])
        target.keep(batch, torch.ones(1, dtype=torch.long))
        batch.settle([context + j + 1])
    return torch.equal(torch.stack(steps, dim=1), verify)


@BF16
def test_verify_rows_equal_one_token_steps(target):
    assert all(_same_logits(target, context, seed) for seed, context in enumerate(CONTEXTS))


@BF16
def test_fused_attention_is_not_invariant(target):
    assert not all(_same_logits(target, context, seed, invariant=False) for seed, context in enumerate(CONTEXTS))


def _engine(target: Target, **config) -> SpeculativeEngine:
    return SpeculativeEngine(target, None, GenerationConfig(max_new_tokens=4, temperature=0.0, **config), stop_ids=[])


def test_the_default_rule():
    """On where it is free (compiled rounds of FREE_INVARIANCE_ROWS rows or more), off elsewhere."""
    target = Target.load(None, dtype="float32")
    for graphs, rows, on in (("eager", 1, False), ("eager", 8, False), ("compile", 1, False), ("compile", 8, True)):
        assert GenerationConfig(graphs=graphs, max_batch=rows).batch_invariance(target) is on
    assert GenerationConfig(graphs="compile", max_batch=8, batch_invariant=False).batch_invariance(target) is False
    assert GenerationConfig(batch_invariant=True).batch_invariance(target) is True


def test_the_setting_reaches_the_batch():
    """Either setting is its engine's batch's (windows a multiple of WINDOW_MULTIPLE, or exact),
    the target being shared."""
    target = Target.load(None, dtype="float32")
    invariant, fused = _engine(target, batch_invariant=True), _engine(target)
    assert invariant.batch_invariant and not fused.batch_invariant
    for engine, multiple in ((invariant, WINDOW_MULTIPLE), (fused, 1)):
        engine.generate([list(range(5, 25))])
        batch = engine._session.batch
        assert (batch.invariant, batch.window_multiple) == (engine.batch_invariant, multiple)
        assert batch.window(WINDOW_MULTIPLE + 3) == -(-(WINDOW_MULTIPLE + 3) // multiple) * multiple


def test_the_setting_needs_dspecs_own_forward(monkeypatch):
    """Where transformers' forward runs, the default is off and asking for it is an error naming why."""
    monkeypatch.setattr(LeanDecoder, "unsupported", staticmethod(lambda model: "transformers' forward under test"))
    target = Target.load(None, dtype="float32")
    assert not _engine(target).batch_invariant and not _engine(target, batch_invariant=False).batch_invariant
    with pytest.raises(DspecError, match=r"needs dspec's own forward.*\(transformers' forward under test\)"):
        _engine(target, batch_invariant=True)
