"""z-lab DFlash: ``DFlashDraftModel`` checkpoints (the original DFlash block layout).

config.json is a Qwen3 config with ``architectures = ["DFlashDraftModel"]``, ``block_size`` B
(16 in z-lab's releases), ``num_target_layers`` and ``dflash_config {mask_token_id,
target_layer_ids}`` (read ``dflash_config`` first, then the top level, as vLLM and z-lab's
code do). Weights: ``fc``, ``hidden_norm``, ``layers.*``, ``norm`` — no embedding or LM head
(both are the target's). The block is [anchor, mask × (B−1)] and only the masks predict, so
it loads as our ``dflash`` with γ = B − 1 and ``anchor_predicts = false`` (z-lab/dflash ``model/dflash.py``).
z-lab's ``auto_map`` (custom modelling code for transformers) is not written on export.
"""

from __future__ import annotations

from dspec_cli import DspecError
from dspec_cli.checkpoints.layouts import (
    Converted,
    arch_config,
    arch_values,
    dtype_fields,
    foreign_state,
    rename_state,
    require,
    value,
)
from dspec_dflash.deepspec_layout import (
    BACKBONE_RULES,
    IGNORED,
    check_layer_types,
)

ARCHITECTURES = ("DFlashDraftModel",)
RULES = BACKBONE_RULES
# dflash_config options of later z-lab / JetSpec drafts that change the computation
UNSUPPORTED = {"causal_head": False, "is_causal": False, "input_embedding_scale": 1.0, "output_multiplier": 1.0,
               "causal": False, "sample_from_anchor": False}
# written explicitly: the block attends both ways and only the masks predict (vLLM reads both from dflash_config)
CONVENTIONS = {"sample_from_anchor": False, "causal": False}


def read(config: dict, tensors: dict, where: str) -> Converted:
    check_layer_types(config, where)
    for key, neutral in UNSUPPORTED.items():
        if value(config, key, neutral) not in (neutral, None):
            raise DspecError(f"{where}: {key} = {value(config, key)!r} is not supported")
    block = int(value(config, "block_size", 16))
    if block < 2:
        raise DspecError(f"{where}: block_size {block} leaves no draft slot (need >= 2)")
    values = {
        **arch_values(config),
        "num_layers": int(require(config, "num_hidden_layers", where)),
        "vocab_size": int(require(config, "vocab_size", where)),
        "block_size": block - 1,
        "target_layer_ids": list(require(config, "target_layer_ids", where)),
        "mask_token_id": int(require(config, "mask_token_id", where)),
        "anchor_predicts": False,
        "layer_style": "qwen3",  # whatever the target: z-lab's draft layers are Qwen3's
    }
    state, _ = rename_state(tensors, RULES, (), IGNORED, where)
    layers = value(config, "num_target_layers")
    return Converted(ARCHITECTURES[0], "dflash", values, state, RULES, {}, None if layers is None else int(layers))


def write(drafter, target) -> tuple[dict, dict]:
    cfg = drafter.config
    if drafter.name != "dflash" or cfg.anchor_predicts:
        raise DspecError("the z-lab DFlash layout needs a dflash drafter with anchor_predicts = false")
    if cfg.layer_style != "qwen3":
        raise DspecError(f"z-lab's DFlashDraftModel has Qwen3 draft layers, not {cfg.layer_style!r} ones")
    config = {
        "architectures": list(ARCHITECTURES),
        "model_type": "qwen3",
        **arch_config(cfg),
        **dtype_fields(drafter.net.backbone.dtype),
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_target_layers": target.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size + 1,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          **CONVENTIONS},
    }
    return config, foreign_state(drafter.net.state_dict(), RULES)
