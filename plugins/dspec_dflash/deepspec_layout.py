"""DeepSpec (the DSpark authors' code): ``Qwen3DSparkModel`` / ``Gemma4DSparkModel`` checkpoints
of dspark and dflash.

config.json is a copy of the target's config with ``architectures = ["Qwen3DSparkModel"]``,
``num_hidden_layers`` (draft layers), ``num_target_layers``, ``block_size`` (B inputs = B
drafts: the anchor slot predicts), ``mask_token_id``, ``target_layer_ids``, ``num_anchors``,
``enable_confidence_head``, ``confidence_head_with_markov``, ``markov_rank`` (0 = DeepSpec's
DFlash) and ``markov_head_type`` (DeepSpec ``deepspec/modeling/dspark/qwen3/config.py``). Weights sit at the
top level: ``fc``, ``hidden_norm``, ``layers.*``, ``norm``, ``markov_head.markov_w1`` (W1 [V, r]),
``markov_head.markov_w2`` (W2 [V, r]), ``markov_head.joint_proj`` (RNN [3r, 2r+d] + bias),
``confidence_head.proj`` ([1, d(+r)] + bias), plus frozen copies of the target's
``embed_tokens`` and ``lm_head``, which must equal the target's.

``Gemma4DSparkModel`` (``deepspec/modeling/dspark/gemma4``): config.json is a copy of the
target's Gemma-4 *text* config (``model_type`` gemma4_text; a nested ``text_config`` is read
too) with the same DSpark fields. Its draft layers are the backbone's ``layer_style = "gemma4"``:
head dim ``global_head_dim``; KV heads ``num_global_key_value_heads`` when ``attention_k_eq_v``
(then no ``v_proj``: V reuses the K projection), else ``num_key_value_heads``; RoPE = the
``full_attention`` entry of the per-layer-type ``rope_parameters``; activation
``hidden_activation``. Extra tensors per layer: ``pre_feedforward_layernorm``,
``post_feedforward_layernorm`` and the ``layer_scalar`` buffer (the V norm has no weight). MoE
blocks (``enable_moe_block``), per-layer inputs (``hidden_size_per_layer_input``) and
double-wide MLPs on KV-shared layers are refused (DeepSpec asserts the first two away).
"""

from __future__ import annotations

from dspec_cli import DspecError
from dspec_cli.checkpoints.layouts import (
    ARCH_FIELDS,
    Converted,
    arch_config,
    arch_values,
    dtype_fields,
    foreign_state,
    rename_state,
    require,
    value,
)

ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")
STYLES = {"Qwen3DSparkModel": "qwen3", "Gemma4DSparkModel": "gemma4"}  # architecture -> backbone layer_style
BACKBONE_RULES = (
    ("fc", "backbone.fc"),
    ("hidden_norm", "backbone.hidden_norm"),
    ("layers", "backbone.layers"),
    ("norm", "backbone.norm"),
)
RULES = BACKBONE_RULES + (
    ("markov_head.markov_w1", "head.embed"),
    ("markov_head.markov_w2", "head.proj"),
    ("markov_head.joint_proj", "head.gates"),
    ("confidence_head.proj", "confidence.linear"),
)
SHARED = ("embed_tokens.weight", "lm_head.weight")
IGNORED = ("rotary_emb",)
HEADS = {"vanilla": ("dspark-markov", "markov"), "rnn": ("dspark-rnn", "rnn")}  # markov_head_type -> ours
# DeepSpec's block: the anchor slot is the first prediction (vLLM's DSpark speculator reads these; its
# reader of the speculators format defaults sample_from_anchor to false, so they are written)
ANCHOR_FIELDS = {"sample_from_anchor": True, "dspark_bonus_anchor": False}


def check_layer_types(config: dict, where: str) -> None:
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise DspecError(f"{where}: layer_types {sorted(kinds)}: sliding-window draft layers are not supported")


def gemma4_values(config: dict, where: str) -> tuple[dict, dict]:
    """(flat config, BackboneConfig values) of a ``Gemma4DSparkModel`` config.json."""
    text = config.get("text_config")
    flat = {**config, **text, "architectures": config["architectures"]} if isinstance(text, dict) else dict(config)
    if bool(flat.get("enable_moe_block")):
        raise DspecError(f"{where}: enable_moe_block = true: Gemma-4 MoE draft blocks are not supported")
    if int(flat.get("hidden_size_per_layer_input") or 0):
        raise DspecError(f"{where}: hidden_size_per_layer_input = {flat['hidden_size_per_layer_input']}: "
                         "Gemma-4 per-layer inputs are not supported in draft layers")
    layers, shared = int(require(flat, "num_hidden_layers", where)), int(flat.get("num_kv_shared_layers") or 0)
    if bool(flat.get("use_double_wide_mlp")) and 0 < layers - shared < layers:
        raise DspecError(f"{where}: use_double_wide_mlp with num_kv_shared_layers = {shared}: "
                         "double-wide MLPs on KV-shared draft layers are not supported")
    k_eq_v = bool(flat.get("attention_k_eq_v", False))
    full = (flat.get("per_layer_config") or {}).values()  # transformers 5.2x spelling of the global fields
    full = next((v for v in full if isinstance(v, dict) and "head_dim" in v), {})
    head_dim = flat.get("global_head_dim") or full.get("head_dim")
    if head_dim is None:
        raise DspecError(f"{where}: config.json has no 'global_head_dim'")
    kv_key = "num_global_key_value_heads" if k_eq_v else "num_key_value_heads"
    kv = flat.get(kv_key) or (full.get("num_key_value_heads") if k_eq_v else None)
    if kv is None:
        raise DspecError(f"{where}: config.json has no {kv_key!r}")
    rope = flat.get("rope_parameters")
    if isinstance(rope, dict) and "rope_type" not in rope:  # per layer type
        if not isinstance(rope.get("full_attention"), dict):
            raise DspecError(f"{where}: rope_parameters has no 'full_attention' entry")
        rope = rope["full_attention"]
    arch = {**flat, "head_dim": int(head_dim), "num_key_value_heads": int(kv), "rope_parameters": rope}
    if flat.get("hidden_activation") and not flat.get("hidden_act"):
        arch["hidden_act"] = flat["hidden_activation"]
    return flat, {**arch_values(arch), "layer_style": "gemma4", "attention_k_eq_v": k_eq_v}


def read(config: dict, tensors: dict, where: str) -> Converted:
    arch = config["architectures"][0]
    if arch == "Gemma4DSparkModel":
        config, backbone = gemma4_values(config, where)
    else:
        backbone = {**arch_values(config), "layer_style": "qwen3"}
    check_layer_types(config, where)
    rank = int(value(config, "markov_rank", 0))
    kind = str(value(config, "markov_head_type", "vanilla"))
    if rank and kind not in HEADS:
        raise DspecError(f"{where}: markov_head_type {kind!r} is not supported (dspec has {', '.join(HEADS)})")
    if any(value(config, key, want) not in (want, None) for key, want in ANCHOR_FIELDS.items()):
        raise DspecError(f"{where}: sample_from_anchor = false / dspark_bonus_anchor = true (the anchor as a bonus "
                         "token) is not supported: DeepSpec's block predicts from the anchor slot")
    drafter, head = HEADS[kind] if rank else ("dflash", "none")
    confidence = bool(value(config, "enable_confidence_head", False))
    if confidence and bool(value(config, "confidence_head_with_markov", False)) != bool(rank):
        raise DspecError(f"{where}: a confidence head must read the Markov features exactly when markov_rank > 0")
    values = {
        **backbone,
        "num_layers": int(require(config, "num_hidden_layers", where)),
        "vocab_size": int(require(config, "vocab_size", where)),
        "block_size": int(require(config, "block_size", where)),
        "target_layer_ids": list(require(config, "target_layer_ids", where)),
        "mask_token_id": int(require(config, "mask_token_id", where)),
        "num_anchors": int(value(config, "num_anchors", 512)),
        "head": head,
        "markov_rank": rank,
        "confidence_head": confidence,
    }
    state, shared = rename_state(tensors, RULES, SHARED, IGNORED, where)
    layers = value(config, "num_target_layers")
    return Converted(arch, drafter, values, state, RULES, shared, None if layers is None else int(layers))


def layout(drafter) -> str:
    """The DeepSpec architecture of a block drafter: by its backbone's layer style."""
    return {style: arch for arch, style in STYLES.items()}[drafter.config.layer_style]


def _dspark_fields(cfg, target) -> dict:
    rank = cfg.markov_rank if cfg.head != "none" else 0
    out = {
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_target_layers": target.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_anchors": cfg.num_anchors,
        "enable_confidence_head": cfg.confidence_head,
        "markov_rank": rank,
    }
    out["confidence_head_with_markov"] = bool(cfg.confidence_head) and bool(rank)  # vLLM's default is false
    if rank:
        out["markov_head_type"] = {ours: kind for kind, (_, ours) in HEADS.items()}[cfg.head]
        out.update(ANCHOR_FIELDS)  # the anchor slot predicts (readers' defaults differ)
    return out


def _gemma4_config(cfg, target) -> dict:
    """DeepSpec's ``build_draft_config``: the target's text config with the draft's sizes (global
    head dim / KV heads as the Gemma-4 fields), dense layers, no per-layer inputs."""
    tc = target.config.to_dict()
    for key in ("per_layer_config", "architectures", "_name_or_path", "transformers_version", "id2label", "label2id"):
        tc.pop(key, None)
    rope = tc.get("rope_parameters")
    rope = dict(rope) if isinstance(rope, dict) and "rope_type" not in rope else {}
    rope["full_attention"] = dict(cfg.rope_parameters)
    kv = {"num_global_key_value_heads": cfg.num_key_value_heads} if cfg.attention_k_eq_v else {
        "num_key_value_heads": cfg.num_key_value_heads}
    return {
        **tc,
        "model_type": "gemma4_text",
        "target_model_type": str(getattr(target.model.config, "model_type", "gemma4_text")),
        "target_text_model_type": str(getattr(target.config, "model_type", "gemma4_text")),
        **{k: getattr(cfg, k) for k in ARCH_FIELDS if k not in ("head_dim", "hidden_act", "num_key_value_heads")},
        "hidden_activation": cfg.hidden_act,
        "global_head_dim": cfg.head_dim,
        "attention_k_eq_v": bool(cfg.attention_k_eq_v),
        **kv,
        "rope_parameters": rope,
        "enable_moe_block": False,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
    }


def write(drafter, target) -> tuple[dict, dict]:
    """``Qwen3DSparkModel`` or ``Gemma4DSparkModel`` (by the drafter's layer style) config and
    tensors (embedding and LM head copied from the target)."""
    cfg = drafter.config
    if not cfg.anchor_predicts:
        raise DspecError("the DeepSpec layout needs the anchor slot to predict (anchor_predicts = true)")
    arch = layout(drafter)
    if arch == "Gemma4DSparkModel":
        base = _gemma4_config(cfg, target)
    else:
        base = {"model_type": "qwen3", **arch_config(cfg)}
    config = {
        "architectures": [arch],
        **base,
        **dtype_fields(drafter.net.backbone.dtype),
        **_dspark_fields(cfg, target),
    }
    tensors = foreign_state(drafter.net.state_dict(), RULES)
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    tensors["lm_head.weight"] = target.model.get_output_embeddings().weight
    return config, tensors
