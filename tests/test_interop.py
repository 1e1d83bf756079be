"""Foreign checkpoint layouts (``dspec_cli.checkpoints.layouts``).

The tests write DeepSpec ``Qwen3DSparkModel``, z-lab ``DFlashDraftModel`` and SpecForge
``LlamaForCausalLMEagle3`` checkpoints by hand (foreign names and shapes, random weights, sized
for the tiny random Qwen3 target), load them through ``from_pretrained`` and run them through the
engine; our own drafters round-trip through the writers with identical proposals; broken folders
fail in one line naming the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import full_forward, tiny_target

from dspec_cli.checkpoints import layouts as interop
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target

GAMMA = 4


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


# -- foreign checkpoints, written the way their own code saves them ----------------------------


def _rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return 0.1 * torch.randn(*shape, generator=gen)


def _norm(n: int, gen: torch.Generator) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, generator=gen)


def qwen3_layer(prefix: str, tc, gen: torch.Generator, d_in: int | None = None, qk_norm: bool = True) -> dict:
    """One Qwen3/Llama decoder layer's tensors; ``d_in`` = q/k/v input width (EAGLE-3: 2d)."""
    d, hd, ff = tc.hidden_size, tc.head_dim, tc.intermediate_size
    q, kv, d_in = tc.num_attention_heads * hd, tc.num_key_value_heads * hd, d_in or tc.hidden_size
    out = {
        f"{prefix}.input_layernorm.weight": _norm(d, gen),
        f"{prefix}.self_attn.q_proj.weight": _rand(q, d_in, gen=gen),
        f"{prefix}.self_attn.k_proj.weight": _rand(kv, d_in, gen=gen),
        f"{prefix}.self_attn.v_proj.weight": _rand(kv, d_in, gen=gen),
        f"{prefix}.self_attn.o_proj.weight": _rand(d, q, gen=gen),
        f"{prefix}.post_attention_layernorm.weight": _norm(d, gen),
        f"{prefix}.mlp.gate_proj.weight": _rand(ff, d, gen=gen),
        f"{prefix}.mlp.up_proj.weight": _rand(ff, d, gen=gen),
        f"{prefix}.mlp.down_proj.weight": _rand(d, ff, gen=gen),
    }
    if qk_norm:
        out |= {f"{prefix}.self_attn.{n}_norm.weight": _norm(hd, gen) for n in "qk"}
    return out


def block_backbone(tc, taps: int, layers: int, gen: torch.Generator) -> dict:
    """fc, hidden_norm, layers.*, norm: the tensors DeepSpec and z-lab share."""
    d = tc.hidden_size
    out = {"fc.weight": _rand(d, taps * d, gen=gen), "hidden_norm.weight": _norm(d, gen), "norm.weight": _norm(d, gen)}
    for i in range(layers):
        out |= qwen3_layer(f"layers.{i}", tc, gen)
    return out


def dspark_heads(config: dict, V: int, d: int, rank: int, head: str, confidence: bool, gen) -> dict:
    """DeepSpec's Markov / RNN head and confidence head tensors (random); sets their config fields."""
    tensors = {}
    if rank:
        config["markov_head_type"] = head
        tensors |= {f"markov_head.markov_w{i}.weight": _rand(V, rank, gen=gen) for i in (1, 2)}
        if head == "rnn":
            tensors |= {"markov_head.joint_proj.weight": _rand(3 * rank, 2 * rank + d, gen=gen),
                        "markov_head.joint_proj.bias": _rand(3 * rank, gen=gen)}
    if confidence:
        config["confidence_head_with_markov"] = bool(rank)
        tensors |= {"confidence_head.proj.weight": _rand(1, d + rank, gen=gen),
                    "confidence_head.proj.bias": _rand(1, gen=gen)}
    return tensors


def deepspec(target: Target, head: str = "vanilla", rank: int = 8, confidence: bool = True) -> tuple[dict, dict]:
    """DeepSpec's save_pretrained output: the target's config with the DSpark fields (transformers 4
    rope spelling), all weights at the top level, frozen embedding and LM head copies included."""
    tc, gen = target.config, torch.Generator().manual_seed(1)
    config = target.config.to_dict()
    config.pop("rope_parameters", None)
    config |= {
        "architectures": ["Qwen3DSparkModel"], "rope_theta": 10000.0, "num_target_layers": target.num_layers,
        "num_hidden_layers": 2, "block_size": GAMMA, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * 2, "mask_token_id": target.tokenizer.pad_token_id,
        "target_layer_ids": [0, 1], "num_anchors": 512, "enable_confidence_head": confidence, "markov_rank": rank,
    }
    tensors = block_backbone(tc, 2, 2, gen)
    tensors |= dspark_heads(config, tc.vocab_size, tc.hidden_size, rank, head, confidence, gen)
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().clone()
    return config, tensors


def zlab(target: Target) -> tuple[dict, dict]:
    """z-lab DFlash: Qwen3 config + dflash_config, block of γ + 1 slots, no embedding / LM head."""
    config = target.config.to_dict() | {
        "architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "num_target_layers": target.num_layers,
        "block_size": GAMMA + 1,
        "dflash_config": {"mask_token_id": target.tokenizer.pad_token_id, "target_layer_ids": [0, 2]},
    }
    return config, block_backbone(target.config, 2, 2, torch.Generator().manual_seed(2))


def specforge_eagle3(target: Target, draft_vocab: int = 100) -> tuple[dict, dict]:
    """SpecForge EAGLE-3: Llama config, one ``midlayer`` (no q/k norms), reduced vocab with d2t/t2d."""
    tc, gen = target.config, torch.Generator().manual_seed(3)
    d, V = tc.hidden_size, tc.vocab_size
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
        "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.head_dim, "intermediate_size": tc.intermediate_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "num_hidden_layers": 1, "vocab_size": V,
        "draft_vocab_size": draft_vocab, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    }
    used = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    tensors = qwen3_layer("midlayer", tc, gen, d_in=2 * d, qk_norm=False) | {
        "midlayer.hidden_norm.weight": _norm(d, gen), "fc.weight": _rand(d, 3 * d, gen=gen),
        "norm.weight": _norm(d, gen),
        "lm_head.weight": _rand(draft_vocab, d, gen=gen), "d2t": used - torch.arange(draft_vocab), "t2d": t2d,
        "embed_tokens.weight": target.model.get_input_embeddings().weight.detach().clone(),
    }
    return config, tensors


def write(folder, config: dict, tensors: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in tensors.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# -- checks ------------------------------------------------------------------------------------


def check_weights_equal(drafter, tensors: dict) -> None:
    """Every trainable foreign tensor appears exactly once among the drafter's weights, unchanged
    (random values: a wrong mapping cannot match), and nothing else is there."""
    own = list(drafter.net.state_dict().values())
    trainable = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight", "t2d")}
    if "lm_head.weight" in tensors and drafter.name == "eagle3":
        trainable["lm_head.weight"] = tensors["lm_head.weight"]
    assert len(own) == len(trainable)
    for name, tensor in trainable.items():
        hits = [w for w in own if w.shape == tensor.shape and torch.equal(w.to(tensor.dtype), tensor)]
        assert len(hits) == 1, name


def check_engine(target: Target, drafter, n: int = 8) -> None:
    """Greedy speculative decoding equals plain greedy decoding, with drafts verified."""
    prompt = target.render_prompt("The quick brown fox")
    cfg = GenerationConfig(max_new_tokens=n, temperature=0.0, block_size=GAMMA)
    result = SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([prompt])[0]
    plain = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert result.output_ids == plain[0, len(prompt):].tolist()
    assert sum(result.verified) > 0


class ArgmaxSampler:
    greedy = False

    def probs(self, logits):
        return torch.softmax(logits.float(), -1)

    def sample(self, probs, step):
        return probs.argmax(-1)


def proposal(target: Target, drafter):
    """One proposal of γ tokens after a prompt: (tokens, draft_probs, confidence)."""
    prompt = torch.tensor(target.render_prompt("Numbers like 0 1 2"))
    _, taps = full_forward(target, prompt[None], drafter.target_layer_ids)
    state = drafter.init_state()
    drafter.add_requests(state, [prompt[:-1]], [taps[:-1]])
    out = drafter.propose(state, prompt[-1:], GAMMA, ArgmaxSampler())
    return out.tokens, out.draft_probs, out.confidence


# -- loading foreign layouts -------------------------------------------------------------------


@pytest.mark.parametrize("head, rank, name", [("vanilla", 8, "dspark"), ("rnn", 8, "dspark-rnn"), ("", 0, "dflash")])
def test_deepspec_checkpoint(target, tmp_path, head, rank, name):
    config, tensors = deepspec(target, head, rank, confidence=rank > 0)
    drafter = get_drafter_class(name).from_pretrained(write(tmp_path, config, tensors), target)
    cfg = drafter.config
    assert (cfg.block_size, cfg.num_layers, cfg.target_layer_ids, cfg.markov_rank) == (GAMMA, 2, (0, 1), rank)
    assert cfg.anchor_predicts
    assert cfg.confidence_head == (rank > 0) and cfg.rope_parameters["rope_theta"] == 10000.0
    check_weights_equal(drafter, tensors)
    if rank:  # the DSpark heads land where they act: W1 = previous-token table, W2 = logit projection
        assert torch.equal(drafter.net.head.embed.weight, tensors["markov_head.markov_w1.weight"])
        assert torch.equal(drafter.net.head.proj.weight, tensors["markov_head.markov_w2.weight"])
        assert torch.equal(drafter.net.confidence.linear.weight, tensors["confidence_head.proj.weight"])
    check_engine(target, drafter)


def test_zlab_dflash_checkpoint(target, tmp_path):
    config, tensors = zlab(target)
    drafter = get_drafter_class("dflash").from_pretrained(write(tmp_path, config, tensors), target)
    assert drafter.config.block_size == GAMMA and not drafter.config.anchor_predicts  # B = γ + 1 slots
    assert drafter.config.target_layer_ids == (0, 2)
    check_weights_equal(drafter, tensors)
    check_engine(target, drafter)


def test_sharded_weights(target, tmp_path):
    """Weights split over shards listed in model.safetensors.index.json (transformers' format)."""
    config, tensors = zlab(target)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k].contiguous() for k in part}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_weights_equal(get_drafter_class("dflash").from_pretrained(tmp_path, target), tensors)


def test_original_dflash_layout_is_the_anchor_layout_shifted(target):
    """[anchor, mask × γ] with masks predicting = DeepSpec's layout with γ + 1 slots minus slot 0."""
    cls = get_drafter_class("dflash")
    ours = cls.build(cls.config_class(block_size=GAMMA + 1, num_layers=2), target)
    zl = cls.build(cls.config_class(block_size=GAMMA, num_layers=2, anchor_predicts=False), target)
    zl.net.load_state_dict(ours.net.state_dict())
    prompt = torch.tensor(target.render_prompt("hello"))
    _, taps = full_forward(target, prompt[None], ours.target_layer_ids)
    states = ours.init_state(), zl.init_state()
    for d, s in zip((ours, zl), states, strict=True):
        d.add_requests(s, [prompt], [taps])
    anchors = torch.tensor([7])
    torch.testing.assert_close(zl.block_logits(states[1], anchors), ours.block_logits(states[0], anchors)[:, 1:])


def test_specforge_eagle3_checkpoint(target, tmp_path):
    config, tensors = specforge_eagle3(target)
    drafter = get_drafter_class("eagle3").from_pretrained(write(tmp_path, config, tensors), target)
    cfg = drafter.config
    assert (cfg.draft_vocab_size, cfg.target_layer_ids, cfg.qk_norm) == (100, (0, 1, 2), False)
    check_weights_equal(drafter, tensors)
    assert torch.equal(drafter.net.draft_ids(), tensors["t2d"].nonzero().squeeze(1))
    check_engine(target, drafter)


# -- round trips through our writers -----------------------------------------------------------

VARIANTS = [
    ("dspark-markov", dict(markov_rank=16), "Qwen3DSparkModel"),
    ("dspark-rnn", dict(markov_rank=16), "Qwen3DSparkModel"),
    ("dflash", {}, "Qwen3DSparkModel"),
    ("dflash", dict(anchor_predicts=False), "DFlashDraftModel"),
    ("eagle3", dict(qk_norm=False, draft_vocab_size=100), "LlamaForCausalLMEagle3"),
]


def build(name: str, target: Target, **overrides):
    cls = get_drafter_class(name)
    values = dict(block_size=GAMMA) | ({} if name == "eagle3" else dict(num_layers=2))
    torch.manual_seed(5)
    drafter = cls.build(cls.config_class(**values, **overrides), target)
    if name == "eagle3" and drafter.net.d2t is not None:
        drafter.set_vocab_mapping(torch.arange(target.vocab_size).flip(0).float())
    return drafter


@pytest.mark.parametrize("name, overrides, layout", VARIANTS)
def test_round_trip(target, tmp_path, name, overrides, layout):
    """ours -> save -> load -> foreign layout -> load: same weights, identical proposals."""
    build(name, target, **overrides).save_pretrained(tmp_path / "ours")
    ours = get_drafter_class(name).from_pretrained(tmp_path / "ours", target)
    assert interop.write(ours, target, tmp_path / "foreign") == layout
    assert json.loads((tmp_path / "foreign" / "config.json").read_text())["architectures"] == [layout]
    back = get_drafter_class(name).from_pretrained(tmp_path / "foreign", target)
    mine, theirs = ours.net.state_dict(), back.net.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for a, b in zip(proposal(target, ours), proposal(target, back), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


# -- one-line errors ---------------------------------------------------------------------------


def _drop(name):
    return lambda c, t: t.pop(name)


def _set(key, value):
    return lambda c, t: c.update({key: value})


def _unset(key):
    return lambda c, t: c.pop(key)


def _smaller_hidden(config, tensors):
    config.update(hidden_size=32, head_dim=8)
    tensors["fc.weight"] = torch.zeros(32, 64)


def _other_embedding(config, tensors):
    tensors["embed_tokens.weight"] = torch.randn_like(tensors["embed_tokens.weight"])


def _narrow_mlp(config, tensors):
    tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:96]


ERRORS = [
    (_smaller_hidden, "dspark", "drafter hidden size 32 does not match the target's 64"),
    (_drop("layers.1.mlp.down_proj.weight"), "dspark", "tensor 'layers.1.mlp.down_proj.weight' is missing"),
    (_narrow_mlp, "dspark", "'layers.0.mlp.up_proj.weight' has shape [96, 64], the configuration needs [128, 64]"),
    (lambda c, t: t.update({"foo.weight": torch.zeros(2)}), "dspark", "unexpected tensor 'foo.weight'"),
    (_other_embedding, "dspark", "embed_tokens.weight differs from the target's input embedding"),
    (_set("num_target_layers", 36), "dspark", "trained for a target with 36 layers, this target has 3"),
    (_set("vocab_size", 500), "dspark", "drafter vocabulary size 500 does not match the target's 384"),
    (_set("markov_head_type", "gated"), "dspark", "markov_head_type 'gated' is not supported"),
    (_unset("mask_token_id"), "dspark", "config.json has no 'mask_token_id'"),
    (lambda c, t: None, "dflash", "holds a 'dspark-markov' drafter, not 'dflash'"),
    (_set("architectures", ["Gemma4DSparkModel"]), "dspark", "config.json has no 'global_head_dim'"),
    (_set("architectures", ["FooDraftModel"]), "dspark", "architecture 'FooDraftModel' is not a layout dspec can load"),
    (_set("layer_types", ["sliding_attention"] * 2), "dspark", "sliding-window draft layers are not supported"),
]


@pytest.mark.parametrize("mutate, name, message", ERRORS)
def test_deepspec_errors(target, tmp_path, mutate, name, message):
    config, tensors = deepspec(target)
    mutate(config, tensors)
    write(tmp_path, config, tensors)
    with pytest.raises(DspecError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        get_drafter_class(name).from_pretrained(tmp_path, target)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_other_layout_errors(target, tmp_path):
    config, tensors = specforge_eagle3(target)
    tensors["t2d"] = ~tensors["t2d"]
    with pytest.raises(DspecError, match="t2d does not mark the target ids that d2t maps to"):
        get_drafter_class("eagle3").from_pretrained(write(tmp_path / "t2d", config, tensors), target)
    config, tensors = specforge_eagle3(target)
    tensors.pop("d2t")
    with pytest.raises(DspecError, match="tensor 'd2t' is missing"):
        get_drafter_class("eagle3").from_pretrained(write(tmp_path / "d2t", config, tensors), target)
    config, tensors = zlab(target)
    config["dflash_config"]["causal_head"] = True
    with pytest.raises(DspecError, match="causal_head = True is not supported"):
        get_drafter_class("dflash").from_pretrained(write(tmp_path / "causal", config, tensors), target)
    folder = write(tmp_path / "corrupt", *zlab(target))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DspecError, match="model.safetensors is corrupt") as err:
        get_drafter_class("dflash").from_pretrained(folder, target)
    assert "\n" not in str(err.value)
