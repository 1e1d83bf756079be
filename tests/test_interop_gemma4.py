"""DeepSpec ``Gemma4DSparkModel`` checkpoints on a tiny random Gemma-4 target.

The checkpoints are written by hand the way DeepSpec saves them (the target's text config with
``global_head_dim`` / ``num_global_key_value_heads`` and the DSpark fields; Gemma-4 draft layers
with sandwich norms, ``layer_scalar`` and, with ``attention_k_eq_v``, no ``v_proj``), loaded
through ``from_pretrained`` and run through the engine; they round-trip through our writer with
identical proposals; one draft layer matches transformers' own Gemma-4 decoder layer."""

from __future__ import annotations

import json

import pytest
import torch
from test_interop import (
    GAMMA,
    _norm,
    _rand,
    check_engine,
    check_weights_equal,
    dspark_heads,
    proposal,
    write,
)
from tiny_models import tiny_gemma4, tiny_tokenizer

from dspec_cli.checkpoints import layouts as interop
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.target import Target

GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS = 32, 1  # tiny_gemma4's full-attention layers


@pytest.fixture(scope="module", params=[True, False], ids=["k_eq_v", "v_proj"])
def target(request) -> Target:
    return Target(tiny_gemma4(seed=0, k_eq_v=request.param), tiny_tokenizer())


def kv_heads(target: Target) -> int:
    return GLOBAL_KV_HEADS if target.config.attention_k_eq_v else target.config.to_dict()["num_key_value_heads"]


def gemma4_layer(prefix: str, target: Target, gen: torch.Generator) -> dict:
    """One ``Gemma4DSparkDecoderLayer``'s tensors (the V norm has no weight)."""
    tc = target.config
    d, hd, ff = tc.hidden_size, GLOBAL_HEAD_DIM, tc.intermediate_size
    q, kv = tc.num_attention_heads * hd, kv_heads(target) * hd
    out = {
        f"{prefix}.input_layernorm.weight": _norm(d, gen),
        f"{prefix}.self_attn.q_proj.weight": _rand(q, d, gen=gen),
        f"{prefix}.self_attn.k_proj.weight": _rand(kv, d, gen=gen),
        f"{prefix}.self_attn.o_proj.weight": _rand(d, q, gen=gen),
        f"{prefix}.self_attn.q_norm.weight": _norm(hd, gen),
        f"{prefix}.self_attn.k_norm.weight": _norm(hd, gen),
        f"{prefix}.post_attention_layernorm.weight": _norm(d, gen),
        f"{prefix}.pre_feedforward_layernorm.weight": _norm(d, gen),
        f"{prefix}.mlp.gate_proj.weight": _rand(ff, d, gen=gen),
        f"{prefix}.mlp.up_proj.weight": _rand(ff, d, gen=gen),
        f"{prefix}.mlp.down_proj.weight": _rand(d, ff, gen=gen),
        f"{prefix}.post_feedforward_layernorm.weight": _norm(d, gen),
        f"{prefix}.layer_scalar": _norm(1, gen),
    }
    if not tc.attention_k_eq_v:
        out[f"{prefix}.self_attn.v_proj.weight"] = _rand(kv, d, gen=gen)
    return out


def gemma4_deepspec(target: Target, head: str = "vanilla", rank: int = 8, confidence: bool = True):
    """DeepSpec's ``build_draft_config`` + ``save_pretrained`` output for a Gemma-4 target (config
    spelled as DeepSpec's transformers writes it: global fields, no ``per_layer_config``)."""
    tc, gen = target.config, torch.Generator().manual_seed(11)
    d, V = tc.hidden_size, tc.vocab_size
    config = tc.to_dict()
    config.pop("per_layer_config")
    config |= {
        "architectures": ["Gemma4DSparkModel"], "target_model_type": "gemma4", "target_text_model_type": "gemma4_text",
        "global_head_dim": GLOBAL_HEAD_DIM, "num_global_key_value_heads": GLOBAL_KV_HEADS,
        "num_target_layers": target.num_layers, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
        "enable_moe_block": False, "hidden_size_per_layer_input": 0, "block_size": GAMMA,
        "tie_word_embeddings": False, "mask_token_id": target.tokenizer.pad_token_id, "target_layer_ids": [0, 1],
        "num_anchors": 512, "enable_confidence_head": confidence, "markov_rank": rank,
    }
    tensors = {"fc.weight": _rand(d, 2 * d, gen=gen), "hidden_norm.weight": _norm(d, gen), "norm.weight": _norm(d, gen)}
    for i in range(2):
        tensors |= gemma4_layer(f"layers.{i}", target, gen)
    tensors |= dspark_heads(config, V, d, rank, head, confidence, gen)
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().clone()
    return config, tensors


@pytest.mark.parametrize("head, rank, name", [("vanilla", 8, "dspark"), ("rnn", 8, "dspark-rnn"), ("", 0, "dflash")])
def test_gemma4_checkpoint(target, tmp_path, head, rank, name):
    """Loads with the Gemma-4 layer style, every tensor lands once, decoding stays lossless."""
    config, tensors = gemma4_deepspec(target, head, rank, confidence=rank > 0)
    drafter = get_drafter_class(name).from_pretrained(write(tmp_path, config, tensors), target)
    cfg = drafter.config
    assert (cfg.layer_style, cfg.attention_k_eq_v) == ("gemma4", target.config.attention_k_eq_v)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.hidden_act) == (GLOBAL_HEAD_DIM, kv_heads(target), "gelu_pytorch_tanh")
    assert cfg.rope_parameters["rope_type"] == "proportional" and cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert (cfg.block_size, cfg.num_layers, cfg.target_layer_ids, cfg.markov_rank) == (GAMMA, 2, (0, 1), rank)
    check_weights_equal(drafter, tensors)
    layer = drafter.net.backbone.layers[0]
    assert torch.equal(layer.layer_scalar, tensors["layers.0.layer_scalar"])
    assert (layer.self_attn.v_proj is None) == target.config.attention_k_eq_v
    assert drafter.softcap == 30.0  # the target's final-logit softcap, applied by the drafter's LM head
    check_engine(target, drafter)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_gemma4_round_trip(target, tmp_path, name):
    """DeepSpec folder -> load -> our writer -> load, and -> our own format -> load: same weights,
    identical proposals; the writer names the Gemma-4 layout."""
    rank = 8 if name == "dspark" else 0
    config, tensors = gemma4_deepspec(target, rank=rank, confidence=bool(rank))
    first = get_drafter_class(name).from_pretrained(write(tmp_path / "theirs", config, tensors), target)
    assert interop.write(first, target, tmp_path / "foreign") == "Gemma4DSparkModel"
    written = json.loads((tmp_path / "foreign" / "config.json").read_text())
    assert written["global_head_dim"] == GLOBAL_HEAD_DIM and written["model_type"] == "gemma4_text"
    assert written["attention_k_eq_v"] == target.config.attention_k_eq_v
    first.save_pretrained(tmp_path / "ours")
    for folder in ("foreign", "ours"):
        back = get_drafter_class(name).from_pretrained(tmp_path / folder, target)
        assert back.config.layer_style == "gemma4"
        mine, theirs = first.net.state_dict(), back.net.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        for a, b in zip(proposal(target, first), proposal(target, back), strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_native_drafter_on_gemma4_target(target):
    """A dflash drafter built on a Gemma-4 target takes DeepSpec's Gemma-4 layers by default."""
    cls = get_drafter_class("dflash")
    torch.manual_seed(0)
    drafter = cls.build(cls.config_class(block_size=GAMMA, num_layers=2), target)
    assert drafter.config.layer_style == "gemma4" and drafter.config.head_dim == GLOBAL_HEAD_DIM
    check_engine(target, drafter)
    qwen = cls.build(cls.config_class(block_size=GAMMA, num_layers=2, layer_style="qwen3"), target)
    assert not hasattr(qwen.net.backbone.layers[0], "layer_scalar")


def test_gemma4_layer_matches_transformers(target):
    """With no context, one draft layer equals transformers' Gemma-4 full-attention decoder layer
    (bidirectional over the block) loaded with the same weights."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4TextDecoderLayer,
        Gemma4TextRotaryEmbedding,
    )

    cls = get_drafter_class("dflash")
    torch.manual_seed(3)
    drafter = cls.build(cls.config_class(block_size=GAMMA, num_layers=1), target)
    ours = drafter.net.backbone.layers[0]
    with torch.no_grad():
        for p in ours.parameters():  # norms away from 1, so a (1 + w) convention would not match
            p.add_(0.1 * torch.randn_like(p))
        ours.layer_scalar.fill_(0.7)
    tc = target.config.to_dict()
    one = Gemma4TextConfig(
        **{k: tc[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                              "rms_norm_eps", "rope_parameters", "attention_k_eq_v", "max_position_embeddings")},
        num_key_value_heads=tc["num_key_value_heads"], num_hidden_layers=1, layer_types=["full_attention"],
        global_head_dim=GLOBAL_HEAD_DIM, num_global_key_value_heads=GLOBAL_KV_HEADS, hidden_size_per_layer_input=0,
    )
    one._attn_implementation = "sdpa"
    theirs = Gemma4TextDecoderLayer(one, 0).eval()
    theirs.load_state_dict(ours.state_dict())
    theirs.self_attn.is_causal = False
    x = torch.randn(2, GAMMA, target.hidden_size)
    pos = torch.arange(5, 5 + GAMMA).expand(2, GAMMA)
    cos, sin = Gemma4TextRotaryEmbedding(one)(x, pos, "full_attention")
    hd, kv = GLOBAL_HEAD_DIM, ours.self_attn.kv_heads
    empty = x.new_zeros(2, kv, 0, hd)
    mask = torch.ones(2, 1, GAMMA, GAMMA, dtype=torch.bool)
    with torch.no_grad():
        mine = ours(x, *drafter.net.backbone.rotary(pos, x.dtype), empty, empty, mask)
        ref = theirs(x, shared_kv_states={}, position_embeddings=(cos, sin), attention_mask=None)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_gemma4_context_injection_formula(target):
    """With context, the attention is DeepSpec's ``Gemma4DSparkAttention``: q = q_norm(Wq x);
    K = k_norm([Wk H ; Wk x]); V = v_norm([Wv H ; Wv x]) (Wv = Wk with k_eq_v); RoPE on q and K;
    scale 1 (written out here from DeepSpec's code)."""
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4RMSNorm,
        apply_rotary_pos_emb,
    )

    cls = get_drafter_class("dflash")
    torch.manual_seed(4)
    drafter = cls.build(cls.config_class(block_size=GAMMA, num_layers=1), target)
    attn, rot = drafter.net.backbone.layers[0].self_attn, drafter.net.backbone.rotary
    H, hd, C = attn.heads, attn.head_dim, 6
    x, ctx = torch.randn(1, GAMMA, target.hidden_size), torch.randn(1, C, target.hidden_size)
    pos = torch.arange(C + GAMMA)[None]
    cos, sin = rot(pos, x.dtype)
    with torch.no_grad():
        k_ctx, v_ctx = attn.project_kv(ctx, cos[:, :C], sin[:, :C])
        mine = attn(x, cos[:, C:], sin[:, C:], k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                    torch.ones(1, 1, GAMMA, C + GAMMA, dtype=torch.bool))
        v_norm = Gemma4RMSNorm(hd, eps=attn.k_norm.eps, with_scale=False)
        both = torch.cat([ctx, x], 1)
        q = attn.q_norm(attn.q_proj(x).view(1, GAMMA, H, hd)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(both).view(1, C + GAMMA, -1, hd)).transpose(1, 2)
        v = v_norm((attn.k_proj if attn.v_proj is None else attn.v_proj)(both).view(1, C + GAMMA, -1, hd)).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos[:, C:], sin[:, C:], unsqueeze_dim=1)
        k = apply_rotary_pos_emb(k, cos, sin, unsqueeze_dim=1).repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
        w = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # scale 1
        ref = attn.o_proj((w @ v).transpose(1, 2).reshape(1, GAMMA, -1))
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


# -- one-line errors ---------------------------------------------------------------------------


def _drop(name):
    return lambda c, t: t.pop(name)


def _set(key, value):
    return lambda c, t: c.update({key: value})


def _toggle_v_proj(config, tensors):
    """k_eq_v checkpoints gain a v_proj (unexpected), v_proj ones lose it (missing)."""
    name = "layers.0.self_attn.v_proj.weight"
    if tensors.pop(name, None) is None:
        tensors[name] = tensors["layers.0.self_attn.k_proj.weight"].clone()


ERRORS = [
    (_drop("layers.1.post_feedforward_layernorm.weight"), "tensor 'layers.1.post_feedforward_layernorm.weight' is missing"),
    (_drop("layers.0.layer_scalar"), "tensor 'layers.0.layer_scalar' is missing"),
    (_toggle_v_proj, "tensor 'layers.0.self_attn.v_proj.weight'"),
    (_set("enable_moe_block", True), "enable_moe_block = true: Gemma-4 MoE draft blocks are not supported"),
    (_set("hidden_size_per_layer_input", 256), "hidden_size_per_layer_input = 256: Gemma-4 per-layer inputs"),
    (lambda c, t: c.update(use_double_wide_mlp=True, num_kv_shared_layers=1), "double-wide MLPs on KV-shared"),
    (lambda c, t: c.pop("global_head_dim"), "config.json has no 'global_head_dim'"),
    (_set("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters has no 'full_attention' entry"),
    (_set("layer_types", ["sliding_attention"] * 2), "sliding-window draft layers are not supported"),
    (_set("num_target_layers", 48), "trained for a target with 48 layers, this target has 3"),
]


@pytest.mark.parametrize("mutate, message", ERRORS)
def test_gemma4_errors(target, tmp_path, mutate, message):
    config, tensors = gemma4_deepspec(target)
    mutate(config, tensors)
    write(tmp_path, config, tensors)
    with pytest.raises(DspecError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        get_drafter_class("dspark").from_pretrained(tmp_path, target)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_gemma4_export_for_vllm(target, tmp_path):
    """``dspec export``: a Gemma-4 dspark drafter is written as Gemma4DSparkModel (vLLM's dspark)."""
    from dspec_cli.workflows import export as serving

    config, tensors = gemma4_deepspec(target, rank=8, confidence=True)
    drafter = get_drafter_class("dspark").from_pretrained(write(tmp_path / "in", config, tensors), target)
    report = serving.export(drafter, target, "vllm", tmp_path / "out", "tiny-gemma4")
    assert (report["layout"], report["method"]) == ("Gemma4DSparkModel", "dspark")
    assert get_drafter_class("dspark").from_pretrained(tmp_path / "out", target).config.layer_style == "gemma4"


def test_gemma4_training_equals_inference(target):
    """The training forward (all blocks at once under the block mask) gives the inference
    forward's logits with Gemma-4 layers, and a training step's loss is finite."""
    from test_backbone import B, assert_training_matches_inference
    from tiny_models import training_batch

    cls = get_drafter_class("dspark")
    torch.manual_seed(0)
    drafter = cls.build(cls.config_class(block_size=B, num_layers=2, markov_rank=8), target)
    assert_training_matches_inference(drafter, target)
    batch, features = training_batch(target, drafter.target_layer_ids)
    loss = drafter.training_loss(batch, features, torch.Generator().manual_seed(0))["loss"]
    assert torch.isfinite(loss)
    loss.backward()
