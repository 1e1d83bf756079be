"""The parallel block backbone: training forward == inference forward, masks, the context cache."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import GreedySampler, full_forward, tiny_target

from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.nn.backbone import (
    build_blocks,
    build_target_layer_ids,
    sample_anchors,
    training_mask,
)
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.verify import verify_greedy_grid

B = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=0)


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    cls = get_drafter_class("dflash")
    return cls.build(cls.config_class(block_size=B, num_layers=2), target)


@pytest.fixture(scope="module")
def sequence(target, drafter):
    ids = torch.tensor([target.render_prompt("The quick brown fox jumps over the lazy dog")])
    _, taps = full_forward(target, ids, drafter.target_layer_ids)
    return ids, taps[None]  # [1, L], [1, L, n·d]


def test_build_target_layer_ids():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert build_target_layer_ids(28, 1) == (14,)
    assert build_target_layer_ids(3, 2) == (0, 2)
    assert build_target_layer_ids(3, 5) == (0, 1, 2)


def _train_hidden(drafter, ids, taps, anchors, impl="dense"):
    keep = torch.ones_like(anchors, dtype=torch.bool)
    blocks = build_blocks(ids, torch.ones_like(ids), anchors, keep, B, drafter.config.mask_token_id)
    mask = training_mask(anchors, keep, ids.shape[1], B, impl)
    embeds = drafter.embed(blocks.input_ids.flatten(1))
    h = drafter.net.backbone.forward_train(embeds, blocks.positions.flatten(1), taps, mask)
    return h.view(1, anchors.shape[1], B, -1)[0]  # [N, B, d]


def _infer_hidden(drafter, ids, taps, anchors):
    """One row per anchor, each with the context strictly before its anchor."""
    bb = drafter.net.backbone
    cache = bb.new_cache()
    cache.add_rows(len(anchors))
    counts = torch.tensor(anchors)
    bb.extend_cache(cache, torch.cat([taps[0, :a] for a in anchors]), counts, max(anchors))
    state = drafter.init_state()
    state.cache = cache
    return drafter.block_hidden(state, ids[0, anchors])  # [N, B, d]


def test_training_forward_matches_inference(drafter, sequence):
    ids, taps = sequence
    anchors = [2, 7, 11, ids.shape[1] - 2]
    with torch.no_grad():
        train = drafter.lm_logits(_train_hidden(drafter, ids, taps, torch.tensor([anchors])))
        infer = drafter.lm_logits(_infer_hidden(drafter, ids, taps, anchors))
    torch.testing.assert_close(train, infer, atol=1e-4, rtol=0)


def test_flex_mask_matches_dense(drafter, sequence):
    ids, taps = sequence
    anchors = torch.tensor([[1, 5, 9]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = _train_hidden(drafter, ids, taps, anchors, "dense")
        flex = _train_hidden(drafter, ids, taps, anchors, "flex")
    torch.testing.assert_close(dense, flex, atol=1e-4, rtol=0)


def test_context_is_strictly_before_the_anchor(drafter, sequence):
    """A block sees taps < a only, and nothing of the other blocks."""
    ids, taps = sequence
    a = 8
    anchors = torch.tensor([[3, a]])
    with torch.no_grad():
        base = _train_hidden(drafter, ids, taps, anchors)
        later = taps.clone()
        later[:, a:] += 1.0  # the anchor's own and later taps
        assert torch.allclose(_train_hidden(drafter, ids, later, anchors)[1], base[1], atol=1e-6)
        earlier = taps.clone()
        earlier[:, a - 1] += 1.0
        assert not torch.allclose(_train_hidden(drafter, ids, earlier, anchors)[1], base[1], atol=1e-3)
        other = ids.clone()
        other[0, 3] = (other[0, 3] + 1) % drafter.config.vocab_size  # the other block's anchor token
        assert torch.allclose(_train_hidden(drafter, other, taps, anchors)[1], base[1], atol=1e-6)


def test_sample_anchors_and_blocks():
    L = 20
    loss_mask = torch.zeros(2, L, dtype=torch.long)
    loss_mask[0, 5:15] = 1  # candidates 5..13
    loss_mask[1, 2:5] = 1  # candidates 2, 3
    ids = torch.arange(100, 100 + 2 * L).view(2, L)
    gen = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(loss_mask, 6, gen)
    again, _ = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    assert anchors.shape == (2, 6)
    assert keep[0].all() and keep[1].tolist() == [True, True, False, False, False, False]
    a0 = anchors[0].tolist()
    assert a0 == sorted(set(a0)) and all(5 <= a <= 13 for a in a0)
    assert anchors[1, :2].tolist() == [2, 3] and (anchors[1, 2:] == 0).all()
    blocks = build_blocks(ids, loss_mask, anchors, keep, B, mask_token_id=7)
    a = anchors[0, 0].item()
    assert blocks.input_ids[0, 0].tolist() == [ids[0, a].item(), 7, 7, 7]
    assert blocks.positions[0, 0].tolist() == [a, a + 1, a + 2, a + 3]
    assert blocks.labels[0, 0].tolist() == ids[0, a + 1 : a + 5].tolist()
    assert blocks.prev[0, 0].tolist() == ids[0, a : a + 4].tolist()
    # row 1: anchor 2 supervises targets 3, 4 (loss_mask ends at 4); anchor 3 only target 4
    assert blocks.valid[1, 0].tolist() == [True, True, False, False]
    assert blocks.valid[1, 1].tolist() == [True, False, False, False]
    assert not blocks.valid[1, 2:].any() and (blocks.input_ids[1, 2:] == 7).all()


@torch.no_grad()
def _manual_greedy_rounds(target, drafter, prompts, rounds):
    """The engine's cycle by hand; checks the draft cache after every propose and advance.
    Returns the state and each row's committed tokens."""
    batch = target.new_batch(drafter.target_layer_ids)
    out = target.prefill(batch, prompts)
    state = drafter.init_state()
    drafter.add_requests(state, [torch.tensor(p) for p in prompts], out.hidden)
    assert torch.equal(state.cache.lengths, batch.lengths)
    anchors = out.logits.argmax(-1)
    committed = [list(p) for p in prompts]
    sampler = GreedySampler()
    for _ in range(rounds):
        keys = [k.clone() for k in state.cache.keys]
        prop = drafter.propose(state, anchors, B, sampler)
        assert all(torch.equal(k, k2) for k, k2 in zip(keys, state.cache.keys, strict=True))  # block K/V never stored
        grid = torch.cat([anchors[:, None], prop.tokens], 1)  # [R, B+1]
        logits, taps = target.score(batch, grid, None, batch.window(B + 1))
        res = verify_greedy_grid(logits, prop.tokens, prop.lengths)
        keep = res.accepted + 1
        target.keep(batch, keep)
        batch.settle(batch.lengths.tolist())
        tokens = grid.flatten()
        sel = (torch.arange(B + 1)[None, :] < keep[:, None]).flatten()
        drafter.advance(state, tokens[sel], keep, taps.flatten(0, 1)[sel])
        assert torch.equal(state.cache.lengths, batch.lengths)  # context == committed tokens
        for r, chunk in enumerate(torch.split(tokens[sel], keep.tolist())):
            committed[r] += chunk.tolist()
        anchors = res.tokens.gather(1, res.accepted[:, None]).squeeze(1)
    return state, committed


def test_cache_holds_exactly_the_committed_context(target, drafter):
    prompts = [target.render_prompt("Speculative decoding drafts"), target.render_prompt("def add(a, b):")]
    state, committed = _manual_greedy_rounds(target, drafter, prompts, rounds=4)
    bb = drafter.net.backbone
    for r, seq in enumerate(committed):  # incremental cache == cache built from the whole sequence
        _, taps = full_forward(target, torch.tensor([seq]), drafter.target_layer_ids)
        fresh = bb.new_cache()
        fresh.add_rows(1)
        bb.extend_cache(fresh, taps, torch.tensor([len(seq)]), len(seq))
        assert int(state.cache.lengths[r]) == len(seq)
        for k_inc, k_new in zip(state.cache.keys + state.cache.values, fresh.keys + fresh.values, strict=True):
            torch.testing.assert_close(k_inc[r, :, : len(seq)], k_new[0, :, : len(seq)], atol=1e-4, rtol=0)


def test_rows_are_independent(target, drafter):
    """Continuous batching: removing or adding rows does not change another row's block."""
    prompts = [target.render_prompt(p) for p in ("The quick brown fox", "Numbers like 0 1 2", "def add(a, b):")]
    batch = target.new_batch(drafter.target_layer_ids)
    out = target.prefill(batch, prompts)
    state = drafter.init_state()
    drafter.add_requests(state, [torch.tensor(p) for p in prompts], out.hidden)
    anchors = out.logits.argmax(-1)
    full = drafter.block_logits(state, anchors)
    drafter.remove_requests(state, [2, 0])
    torch.testing.assert_close(drafter.block_logits(state, anchors[[2, 0]]), full[[2, 0]], atol=1e-5, rtol=0)
    extra = target.prefill(target.new_batch(drafter.target_layer_ids), [prompts[1]])
    drafter.add_requests(state, [torch.tensor(prompts[1])], extra.hidden)
    torch.testing.assert_close(drafter.block_logits(state, anchors[[2, 0, 1]]), full[[2, 0, 1]], atol=1e-5, rtol=0)


def assert_training_matches_inference(drafter, target) -> None:
    """The training forward (all blocks under the block mask) gives the inference forward's
    logits at three anchors of one prompt."""
    ids = torch.tensor([target.render_prompt("The quick brown fox jumps over the lazy dog")])
    _, taps = full_forward(target, ids, drafter.target_layer_ids)
    anchors = [3, 9, ids.shape[1] - 2]
    with torch.no_grad():
        train = drafter.lm_logits(_train_hidden(drafter, ids, taps[None], torch.tensor([anchors])))
        infer = drafter.lm_logits(_infer_hidden(drafter, ids, taps[None], anchors))
    torch.testing.assert_close(train, infer, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_other_target_families(family):
    """Llama / Gemma 3 targets: training == inference, and greedy decoding stays exact."""
    target = tiny_target(family, seed=0)
    torch.manual_seed(0)
    cls = get_drafter_class("dflash")
    drafter = cls.build(cls.config_class(block_size=B, num_layers=2), target)
    assert_training_matches_inference(drafter, target)
    prompt = target.render_prompt("Numbers like 0 1 2")
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, block_size=B)
    out = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([prompt])[0].output_ids
    plain = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == plain[0, len(prompt) :].tolist()


@pytest.mark.parametrize("anchor_predicts", [True, False], ids=["deepspec-layout", "zlab-layout"])
def test_training_path_matches_inference_in_both_block_layouts(target, sequence, anchor_predicts):
    """``block_outputs`` (all blocks under the block mask, heads teacher-forced) gives each draft
    slot's inference logits and confidence, in DeepSpec's layout and in the original DFlash
    one ([anchor, mask × γ], masks predict), with labels x_{a+1..a+γ}."""
    torch.manual_seed(1)
    cls = get_drafter_class("dspark-rnn")  # a stateful head: the previous-token alignment matters
    drafter = cls.build(cls.config_class(block_size=B, num_layers=2, anchor_predicts=anchor_predicts), target)
    ids, taps = sequence
    anchors = [2, 7, ids.shape[1] - B - 2]  # every slot supervised in both layouts
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    features = {"taps": taps, "last_hidden": torch.zeros(*ids.shape, target.hidden_size)}
    with torch.no_grad():
        out = drafter.block_outputs(batch, features, torch.tensor([anchors]), torch.ones(1, 3, dtype=torch.bool))
        h = _infer_hidden(drafter, ids, taps, anchors)  # [N, γ, d]
        base, state, logits, conf = drafter.lm_logits(h), None, [], []
        for k in range(B):
            prev = ids[0, [a + k for a in anchors]]  # teacher-forced x_{a+k}
            step, state = drafter.head_logits(base[:, k], h[:, k], prev, state)
            logits.append(step)
            conf.append(drafter.net.confidence(h[:, k], drafter.net.head.embed(prev)))
    assert out.labels.view(3, B).tolist() == [ids[0, a + 1 : a + 1 + B].tolist() for a in anchors]
    torch.testing.assert_close(out.logits.view(3, B, -1), torch.stack(logits, 1), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.conf_logits.view(3, B), torch.stack(conf, 1), atol=1e-4, rtol=0)
