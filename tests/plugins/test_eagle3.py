"""``eagle3``: engine identity and losslessness, inference = training-time test, EAGLE-2 trees,
draft vocabulary, training loss, checkpoints and their errors (tiny random Qwen3, fp32)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from dspec_eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    build_vocab_mapping,
    default_layer_ids,
    ttt_attention_mask,
)
from dspec_eagle3.loss import ttt_outputs
from tiny_models import full_forward, tiny_target, tiny_tokenizer, training_batch
from transformers import AutoModelForCausalLM, Qwen3Config

from dspec_cli.core import sampling
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, RoundSampler, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.runtime.verify import verify_tree
from dspec_cli.testing import check_engine_lossless, gof_test

PROMPTS = ["Speculative decoding drafts", "The quick brown fox", "Numbers like 0 1 2"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Speculative decoding drafts several tokens with a small model and verifies them.",
]
TREE = dict(tree=True, tree_top_k=2, tree_depth=4, tree_total_tokens=12)


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


def build(target: Target, seed: int = 1, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return Eagle3Drafter.build(Eagle3Config(**{"block_size": 4, **overrides}), target)


def plain_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def sampler(rows: int, steps: int) -> RoundSampler:
    """T = 1, no top-k/top-p: q = softmax(full-vocabulary draft logits)."""
    zeros = torch.zeros(rows, dtype=torch.long)
    return RoundSampler(GenerationConfig(temperature=1.0), zeros, zeros + 1, steps)


# -- a hand-driven decoding loop (propose, verify, commit any prefix, advance) ---------------


class Driver:
    """Rows of committed ids on the host plus the target batch and the drafter state."""

    def __init__(self, target: Target, drafter: Eagle3Drafter):
        self.target, self.drafter = target, drafter
        self.batch = target.new_batch(drafter.target_layer_ids)
        self.state = drafter.init_state()
        self.seqs: list[list[int]] = []
        self.anchors = torch.empty(0, dtype=torch.long)

    def admit(self, prompts: list[list[int]]) -> None:
        out = self.target.prefill(self.batch, prompts)
        self.drafter.add_requests(self.state, [torch.tensor(p) for p in prompts], out.hidden)
        self.seqs += [list(p) for p in prompts]
        self.anchors = torch.cat([self.anchors, out.logits.argmax(-1)])

    def remove(self, row: int) -> None:
        keep = [r for r in range(len(self.seqs)) if r != row]
        self.target.select_rows(self.batch, keep)
        self.drafter.remove_requests(self.state, keep)
        self.seqs.pop(row)
        self.anchors = self.anchors[keep]

    def commit(self, tokens: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor, anchors) -> None:
        self.drafter.advance(self.state, tokens, counts, hidden)
        for r, chunk in enumerate(torch.split(tokens, counts.tolist())):
            self.seqs[r] += chunk.tolist()
        self.anchors = anchors
        assert (self.state.cache.lengths + 1).tolist() == self.batch.bounds  # pending = last committed

    def chain_round(self, gen: torch.Generator, gamma: int = 3) -> None:
        """Propose γ drafts, commit the anchor and a random number of them, pick a random anchor."""
        R = len(self.seqs)
        prop = self.drafter.propose(self.state, self.anchors, gamma, sampler(R, gamma))
        tokens = torch.cat([self.anchors[:, None], prop.tokens], 1)  # [R, γ+1]
        with torch.no_grad():
            _, taps = self.target.score(self.batch, tokens, None, self.batch.window(gamma + 1))
        keep = torch.randint(0, gamma + 1, (R,), generator=gen) + 1
        self.target.keep(self.batch, keep)
        self.batch.settle(self.batch.lengths.tolist())
        sel = (torch.arange(gamma + 1)[None, :] < keep[:, None]).reshape(-1)
        nxt = torch.randint(0, self.target.vocab_size, (R,), generator=gen)
        self.commit(tokens.reshape(-1)[sel], taps.flatten(0, 1)[sel], keep, nxt)

    def tree_round(self, choose) -> tuple:
        """Propose a tree, score it, commit ``choose(logits [R·(N+1), V], tree)`` ([R, D+1] root-first
        path) and return (proposal, path)."""
        prop = self.drafter.propose(self.state, self.anchors, self.drafter.config.tree_depth, sampler(1, 1))
        tree = prop.tree
        R, N = tree.tokens.shape
        tokens = torch.cat([self.anchors[:, None], tree.tokens], 1)  # [R, N+1]
        parents = torch.cat([torch.full((R, 1), -1), tree.parents], 1)
        with torch.no_grad():
            logits, taps = self.target.score(self.batch, tokens, parents, self.batch.window(N + 1))
        path, anchors = choose(logits.flatten(0, 1), tree)
        self.target.keep_path(self.batch, path)
        self.batch.settle(self.batch.lengths.tolist())
        used = path >= 0
        flat = (torch.arange(R)[:, None] * (N + 1) + path.clamp(min=0))[used]
        self.commit(tokens.reshape(-1)[flat], taps.flatten(0, 1)[flat], used.sum(1), anchors)
        return prop, path


def ttt_logits(drafter: Eagle3Drafter, target: Target, seq: list[int], index: int, steps: int) -> torch.Tensor:
    """Full-vocabulary draft logits [steps, V] of the training-time test at ``index`` of ``seq``."""
    ids = torch.tensor([seq])
    _, taps = full_forward(target, ids, drafter.target_layer_ids)
    with torch.no_grad():
        outs = ttt_outputs(drafter.net, drafter.embed, ids, taps[None], torch.ones_like(ids), steps)
        return torch.stack([drafter._full_logits(drafter.net.logits(o[:, index]))[0] for o in outs])


def check_chain_matches_ttt(drafter: Eagle3Drafter, target: Target, drv: Driver, gamma: int = 4) -> None:
    """Chain drafting after the driver's rounds gives the training-time test's distributions."""
    R = len(drv.seqs)
    prop = drafter.propose(drv.state, drv.anchors, gamma, sampler(R, gamma))
    for r in range(R):
        seq = drv.seqs[r] + [int(drv.anchors[r])] + prop.tokens[r, :-1].tolist()
        want = torch.softmax(ttt_logits(drafter, target, seq, len(drv.seqs[r]) - 1, gamma), -1)
        torch.testing.assert_close(prop.draft_probs[r], want, atol=2e-5, rtol=1e-4)


# -- registration and configuration ----------------------------------------------------------


def test_registered_and_config(target):
    assert get_drafter_class("eagle3") is Eagle3Drafter
    assert {"draft_probs", "tree", "trainable"} <= Eagle3Drafter.capabilities
    assert default_layer_ids(36) == (1, 17, 32) and default_layer_ids(8) == (1, 3, 4)
    assert default_layer_ids(3) == (0, 1, 2) and default_layer_ids(1) == (0,)
    drafter = build(target)
    assert drafter.target_layer_ids == (0, 1, 2) and drafter.net.fc.in_features == 3 * 64
    assert build(target, target_layer_ids=(-1, 2)).net.fc.in_features == 2 * 64
    for bad, match in [
        (dict(target_layer_ids=(0, 3)), "target_layer_ids"),
        (dict(num_layers=2), "num_layers"),
        (dict(draft_vocab_size=1000), "draft_vocab_size"),
        (dict(ttt_length=0), "ttt_length"),
        (dict(tree=True, tree_top_k=20, draft_vocab_size=16), "tree_top_k"),
    ]:
        with pytest.raises(DspecError, match=match):
            build(target, **bad)


# -- decoding --------------------------------------------------------------------------------


def test_greedy_equals_plain_greedy(target):
    prompts = [target.render_prompt(p) for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, block_size=4, max_batch=2)
    results = SpeculativeEngine(target, build(target), cfg, stop_ids=[]).generate(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == plain_greedy(target, prompt, 20)
    assert sum(sum(r.verified) for r in results) > 0


@pytest.mark.parametrize("draft_vocab", [0, 96])
def test_inference_matches_training_time_test(target, draft_vocab):
    """Prefill, rounds with random acceptance, a row leaving and one joining: the draft cache
    holds every committed token but the last, and drafting equals the training forward."""
    drafter = build(target, draft_vocab_size=draft_vocab)
    drv = Driver(target, drafter)
    gen = torch.Generator().manual_seed(0)
    prompts = [target.render_prompt(p) for p in PROMPTS]
    drv.admit(prompts[:2])
    drv.chain_round(gen)
    drv.remove(0)
    drv.admit(prompts[2:])
    for _ in range(3):
        drv.chain_round(gen)
    check_chain_matches_ttt(drafter, target, drv)


def test_reduced_vocabulary_probs(target):
    drafter = build(target, draft_vocab_size=64)
    counts = torch.zeros(target.vocab_size)
    counts[torch.arange(100, 164)] = 1.0
    drafter.set_vocab_mapping(counts)
    assert drafter.net.draft_ids().tolist() == list(range(100, 164))
    torch.testing.assert_close(drafter.net.lm_head.weight, target.model.lm_head.weight[100:164])
    drv = Driver(target, drafter)
    drv.admit([target.render_prompt(p) for p in PROMPTS])
    prop = drafter.propose(drv.state, drv.anchors, 3, sampler(3, 3))
    assert ((prop.tokens >= 100) & (prop.tokens < 164)).all()
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[100:164] = False
    assert (prop.draft_probs[..., outside] == 0).all()
    torch.testing.assert_close(prop.draft_probs.sum(-1), torch.ones(3, 3))


def test_draft_tokens_follow_draft_probs(target):
    """x_k is drawn from the reported q_k (T = 0.7, top-p 0.9): chi-square over 2000 rows."""
    drafter = build(target)
    drv = Driver(target, drafter)
    drv.admit([target.render_prompt(PROMPTS[0])] * 2000)
    cfg = GenerationConfig(temperature=0.7, top_p=0.9)
    seeds = torch.arange(2000)
    prop = drafter.propose(drv.state, drv.anchors, 2, RoundSampler(cfg, seeds, torch.ones_like(seeds), 2))
    q = prop.draft_probs[:, 0]
    torch.testing.assert_close(q, q[:1].expand_as(q))
    assert gof_test(prop.tokens[:, 0], q[0]).p_value > 1e-4


def check_lossless(target: Target, drafter, sampling_cfg: dict, num_prompts: int, per_prompt: int,
                   max_batch: int | None = None) -> None:
    """3-token continuations from the engine match exact target sampling (chi-square)."""
    prompts = [target.render_prompt(p) for p in PROMPTS[:num_prompts]]
    results = check_engine_lossless(target, drafter, prompts, per_prompt=per_prompt, sampling=sampling_cfg,
                                    max_batch=max_batch, name="eagle3")
    assert sum(sum(r.accepted) for r in results) > 0  # drafts were really accepted


@pytest.mark.parametrize(
    "sampling_cfg, draft_vocab",
    [(dict(temperature=1.0), 0), (dict(temperature=0.7, top_p=0.9), 0), (dict(temperature=1.0), 96)],
)
def test_lossless_quick(target, sampling_cfg, draft_vocab):
    check_lossless(target, build(target, draft_vocab_size=draft_vocab), sampling_cfg, num_prompts=1, per_prompt=3000)


@pytest.mark.slow
@pytest.mark.parametrize("sampling_cfg", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_lossless_end_to_end(target, sampling_cfg):
    check_lossless(target, build(target), sampling_cfg, num_prompts=3, per_prompt=8000)


# -- EAGLE-2 trees ---------------------------------------------------------------------------


def check_tree(drafter: Eagle3Drafter, target: Target, seqs: list[list[int]], anchors, prop) -> None:
    """Structure, budget, best path, and every node's children = the top tokens of the
    training-time test's distribution along the node's path."""
    cfg, tree = drafter.config, prop.tree
    R, N = tree.tokens.shape
    candidates = cfg.tree_top_k + (cfg.tree_depth - 1) * cfg.tree_top_k**2
    assert N == min(cfg.tree_total_tokens - 1, candidates) and tree.num_nodes.tolist() == [N] * R
    for r in range(R):
        toks, pars = tree.tokens[r].tolist(), tree.parents[r].tolist()
        assert all(0 <= p <= i for i, p in enumerate(pars))  # node i+1's parent precedes it
        paths = {0: []}
        for i, (t, p) in enumerate(zip(toks, pars, strict=True)):
            paths[i + 1] = paths[p] + [t]
        assert max(len(p) for p in paths.values()) <= cfg.tree_depth
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(pars):
            kids.setdefault(p, []).append(toks[i])
        assert all(len(set(k)) == len(k) for k in kids.values())  # distinct siblings
        assert set(kids) <= set(range(N + 1))  # prefix-closed: parents are nodes
        for node, children in kids.items():
            seq = seqs[r] + [int(anchors[r])] + paths[node]
            depth = len(paths[node])
            logits = ttt_logits(drafter, target, seq, len(seqs[r]) - 1, depth + 1)[depth]
            assert set(children) == set(logits.topk(len(children)).indices.tolist())
        best = prop.tokens[r, : prop.lengths[r]].tolist()
        assert prop.lengths[r] >= 1 and best in paths.values()


@pytest.mark.parametrize("draft_vocab", [0, 96])
def test_tree_proposal(target, draft_vocab):
    drafter = build(target, draft_vocab_size=draft_vocab, **TREE)
    drv = Driver(target, drafter)
    drv.admit([target.render_prompt(p) for p in PROMPTS[:2]])
    gen = torch.Generator().manual_seed(0)

    def random_path(logits, tree):  # commit the path to a random node, then a random anchor
        R, N = tree.tokens.shape
        path = torch.full((R, drafter.config.tree_depth + 1), -1)
        for r in range(R):
            node, chain = int(torch.randint(1, N + 1, (1,), generator=gen)), []
            while node:
                chain.append(node)
                node = int(tree.parents[r, node - 1])
            path[r, : len(chain) + 1] = torch.tensor([0] + chain[::-1])
        return path, torch.randint(0, target.vocab_size, (R,), generator=gen)

    for _ in range(2):
        drv.tree_round(random_path)
    prop = drafter.propose(drv.state, drv.anchors, drafter.config.tree_depth, sampler(2, 1))
    check_tree(drafter, target, drv.seqs, drv.anchors, prop)
    short = drafter.propose(drv.state, drv.anchors, 2, sampler(2, 1))  # depth capped by max_len
    p = short.tree.parents
    assert short.tokens.shape[1] == 2 and ((p == 0) | (p.gather(1, (p - 1).clamp(min=0)) == 0)).all()


@pytest.mark.parametrize("rows", [8, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sampling_cfg", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_tree_lossless(target, sampling_cfg, rows):
    """EAGLE-2 trees through the engine (sample-and-match), R concurrent requests."""
    check_lossless(target, build(target, **TREE), sampling_cfg, num_prompts=1, per_prompt=3000, max_batch=rows)


def test_tree_greedy_equals_plain_greedy(target):
    """Tree rounds verified with verify_tree(method="match") at T = 0 reproduce greedy decoding."""
    drafter = build(target, **TREE)
    prompts = [target.render_prompt(p) for p in PROMPTS[:2]]
    drv = Driver(target, drafter)
    drv.admit(prompts)
    outputs = [[int(a)] for a in drv.anchors]

    def greedy_walk(logits, tree):
        probs = sampling.logits_to_probs(logits, 0.0)
        res = verify_tree(probs, tree.tokens.reshape(-1), tree.parents.reshape(-1), tree.num_nodes)
        for r in range(len(outputs)):
            outputs[r] += res.tokens[r, : res.accepted[r] + 1].tolist()
        return res.path, res.tokens.gather(1, res.accepted[:, None]).squeeze(1)

    while min(map(len, outputs)) < 12:
        drv.tree_round(greedy_walk)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out[:12] == plain_greedy(target, prompt, 12)


# -- training --------------------------------------------------------------------------------




def test_ttt_mask_structure():
    valid = torch.tensor([[True, False, True, True]])  # key 1 is padding
    m = ttt_attention_mask(valid, 2)
    assert m.shape == (1, 1, 4, 12) and m.dtype == torch.bool
    first = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m[0, 0, :, :4], first)  # causal over valid keys, plus the diagonal
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(m[0, 0, :, 4:8], eye) and torch.equal(m[0, 0, :, 8:], eye)
    assert ttt_attention_mask(valid, 0).shape == (1, 1, 4, 4)


def test_flex_attention_matches_dense(target):
    drafter = build(target, ttt_length=3)
    batch, feats = training_batch(target, drafter.target_layer_ids)
    args = (drafter.net, drafter.frozen_embed, batch["input_ids"], feats["taps"], batch["attention_mask"], 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense, flex = ttt_outputs(*args, "dense"), ttt_outputs(*args, "flex")
    valid = batch["attention_mask"].bool()
    for d, f in zip(dense, flex, strict=True):
        torch.testing.assert_close(d[valid], f[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("draft_vocab", [0, 128])
def test_training_loss(target, draft_vocab):
    drafter = build(target, draft_vocab_size=draft_vocab, ttt_length=4)
    batch, feats = training_batch(target, drafter.target_layer_ids)
    if draft_vocab:
        with pytest.raises(DspecError, match="prepare_training"):
            drafter.training_loss(batch, feats)
        data = SimpleNamespace(ids=batch["input_ids"].numpy(), mask=batch["loss_mask"].numpy())
        drafter.prepare_training(data)
        used = set(batch["input_ids"][batch["loss_mask"].bool()].tolist())
        assert used <= set(drafter.net.draft_ids().tolist())
    out = drafter.training_loss(batch, feats)
    assert torch.isfinite(out["loss"]) and out["loss"].requires_grad
    n_sup = int(batch["loss_mask"][:, 2:].sum())  # step 0 at t predicts token t+2
    assert out["tokens"] == n_sup if not draft_vocab else 0 < out["tokens"] <= n_sup
    for k in range(1, 5):
        assert 0.0 <= out[f"acc@{k}"] <= 1.0 and 0.0 <= out[f"accept_rate@{k}"] <= 1.0
    rates = [out[f"accept_rate@{k}"] for k in range(1, 5)]
    assert out["tau_probabilistic"] == pytest.approx(1 + sum(torch.tensor(rates).cumprod(0).tolist()))
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = drafter.training_loss(batch, feats)["loss"]
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.trainable_parameters())
    assert losses[-1] < losses[0]


def test_training_loss_step_zero_by_hand(target):
    """ttt_length 1, full vocabulary: the loss is the mean soft CE at every supervised position."""
    drafter = build(target, ttt_length=1)
    batch, feats = training_batch(target, drafter.target_layer_ids)
    out = drafter.training_loss(batch, feats)
    o = ttt_outputs(drafter.net, drafter.embed, batch["input_ids"], feats["taps"], batch["attention_mask"], 1)[0]
    logq = torch.log_softmax(drafter.net.logits(o[:, :-1]), -1)  # [b, L−1, V] at t, target at t+1
    p = torch.softmax(target.model.lm_head(feats["last_hidden"][:, 1:]).float(), -1)
    sel = batch["loss_mask"][:, 2:].bool()
    ce = -(p[:, :-1] * logq[:, :-1]).sum(-1)[sel]
    torch.testing.assert_close(out["loss"], ce.mean())


def test_build_vocab_mapping():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 3])
    d2t, t2d = build_vocab_mapping(counts, 4)
    used = torch.arange(4) + d2t
    assert used.tolist() == [0, 2, 3, 6]  # top-4 counts, ties by lower id, sorted
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    assert torch.equal(t2d.nonzero().squeeze(1), used)  # round trip target <-> draft ids
    assert (torch.cumsum(t2d.long(), 0) - 1)[used].tolist() == [0, 1, 2, 3]
    d2t, _ = build_vocab_mapping(torch.tensor([0, 0, 3]), 3)  # unseen ids fill the set
    assert d2t.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(counts, 9)


# -- checkpoints -----------------------------------------------------------------------------


def test_save_load_round_trip(target, tmp_path):
    drafter = build(target, draft_vocab_size=64)
    counts = torch.zeros(target.vocab_size)
    counts[::6] = 1.0
    drafter.set_vocab_mapping(counts)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["drafter"] == "eagle3" and saved["drafter_config"]["draft_vocab_size"] == 64
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "d2t" in weights and not any("embed_tokens" in k for k in weights)
    assert weights["lm_head.weight"].shape == (64, 64)
    loaded = Eagle3Drafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    assert torch.equal(loaded.net.draft_ids(), torch.arange(0, target.vocab_size, 6))
    drivers = [Driver(target, d) for d in (drafter, loaded)]
    props = []
    for drv in drivers:
        drv.admit([target.render_prompt("hello")])
        props.append(drv.drafter.propose(drv.state, drv.anchors, 3, sampler(1, 3)))
    torch.testing.assert_close(props[0].draft_probs, props[1].draft_probs)


def _other_target(**changes) -> Target:
    cfg = Qwen3Config(**{**tiny_target().config.to_dict(), **changes})
    return Target(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), tiny_tokenizer())


def test_checkpoint_errors(target, tmp_path):
    build(target).save_pretrained(tmp_path)
    with pytest.raises(DspecError, match="hidden size 64 does not match the target's 32"):
        Eagle3Drafter.from_pretrained(tmp_path, _other_target(hidden_size=32, head_dim=8))
    with pytest.raises(DspecError, match="vocabulary size 384 does not match the target's 400"):
        Eagle3Drafter.from_pretrained(tmp_path, _other_target(vocab_size=400))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DspecError, match="corrupt"):
        Eagle3Drafter.from_pretrained(tmp_path, target)
    other = tmp_path / "other"
    build(target, draft_vocab_size=64).save_pretrained(other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["drafter_config"]["draft_vocab_size"] = 32
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DspecError, match="weights do not fit"):
        Eagle3Drafter.from_pretrained(other, target)
    cfg["drafter"] = "dflash"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DspecError, match="holds a 'dflash' drafter"):
        Eagle3Drafter.from_pretrained(other, target)


def test_load_default_without_embedded_drafter(target, monkeypatch, tmp_path):

    monkeypatch.setattr("dspec_cli.checkpoints.persist.embedded_path", lambda name: tmp_path / name)
    with pytest.raises(DspecError, match="dspec train --drafter eagle3"):
        Eagle3Drafter.load_default(target)
    build(target).save_pretrained(tmp_path / "drafters" / "eagle3")
    assert isinstance(Eagle3Drafter.load_default(target), Eagle3Drafter)
    with pytest.raises(DspecError, match="does not fit this target"):
        Eagle3Drafter.load_default(_other_target(vocab_size=400))
