"""DeepSpec (the DSpark authors' code): ``Qwen3DSparkModel`` checkpoints of dspark and dflash.

config.json is a copy of the target's config with ``architectures = ["Qwen3DSparkModel"]``,
``num_hidden_layers`` (draft layers), ``num_target_layers``, ``block_size`` (B inputs = B
drafts: the anchor slot predicts), ``mask_token_id``, ``target_layer_ids``, ``num_anchors``,
``enable_confidence_head``, ``confidence_head_with_markov``, ``markov_rank`` (0 = DeepSpec's
DFlash) and ``markov_head_type`` (notes-ecosystem §3, notes-deepspec §1-2). Weights sit at the
top level: ``fc``, ``hidden_norm``, ``layers.*``, ``norm``, ``markov_head.markov_w1`` (W1 [V, r]),
``markov_head.markov_w2`` (W2 [V, r]), ``markov_head.joint_proj`` (RNN [3r, 2r+d] + bias),
``confidence_head.proj`` ([1, d(+r)] + bias), plus frozen copies of the target's
``embed_tokens`` and ``lm_head``, which must equal the target's.

``Gemma4DSparkModel`` is recognised but not loadable: its decoder layers (sandwich norms, V
norm, a K projection shared with V, ``layer_scalar``, attention scale 1) are not dspec's.
"""

from __future__ import annotations

from dspec_cli.errors import DspecError
from dspec_cli.interop.common import (
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


def check_layer_types(config: dict, where: str) -> None:
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise DspecError(f"{where}: layer_types {sorted(kinds)}: sliding-window draft layers are not supported")


def read(config: dict, tensors: dict, where: str) -> Converted:
    arch = config["architectures"][0]
    if arch == "Gemma4DSparkModel":
        raise DspecError(
            f"{where}: Gemma4DSparkModel is not supported: its Gemma-4 draft layers (sandwich norms, V norm, "
            "K shared with V, layer_scalar) are not implemented by dspec's block backbone"
        )
    check_layer_types(config, where)
    rank = int(value(config, "markov_rank", 0))
    kind = str(value(config, "markov_head_type", "vanilla"))
    if rank and kind not in HEADS:
        raise DspecError(f"{where}: markov_head_type {kind!r} is not supported (dspec has {', '.join(HEADS)})")
    drafter, head = HEADS[kind] if rank else ("dflash", "none")
    confidence = bool(value(config, "enable_confidence_head", False))
    if confidence and bool(value(config, "confidence_head_with_markov", False)) != bool(rank):
        raise DspecError(f"{where}: a confidence head must read the Markov features exactly when markov_rank > 0")
    values = {
        **arch_values(config),
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


def write(drafter, target) -> tuple[dict, dict]:
    """``Qwen3DSparkModel`` config and tensors (embedding and LM head copied from the target)."""
    cfg = drafter.config
    if not cfg.anchor_predicts:
        raise DspecError("the DeepSpec layout needs the anchor slot to predict (anchor_predicts = true)")
    rank = cfg.markov_rank if cfg.head != "none" else 0
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **arch_config(cfg),
        **dtype_fields(drafter.net.backbone.dtype),
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
    if cfg.confidence_head:
        config["confidence_head_with_markov"] = bool(rank)
    if rank:
        config["markov_head_type"] = {ours: kind for kind, (_, ours) in HEADS.items()}[cfg.head]
    tensors = foreign_state(drafter.net.state_dict(), RULES)
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    tensors["lm_head.weight"] = target.model.get_output_embeddings().weight
    return config, tensors
