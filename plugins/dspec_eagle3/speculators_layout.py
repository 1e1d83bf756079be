"""vllm-project/speculators: ``Eagle3Speculator`` checkpoints (``speculators/models/eagle3``).

config.json: ``speculators_model_type`` ``eagle3``, ``transformer_layer_config`` (the decoder layer
as a ``llama`` config — Llama attention, our ``qk_norm = false`` — or a ``qwen3`` one, whose per-head
q/k norms are our ``qk_norm = true``; ``num_hidden_layers`` 1, ``vocab_size`` = the target's),
``draft_vocab_size`` N, ``eagle_aux_hidden_state_layer_ids`` (vLLM indexing, ours + 1; absent:
speculators' default (2, L//2, L−3)), ``target_hidden_size``, the options ``norm_before_residual``,
``norm_before_fc``, ``fc_norm`` and ``norm_output`` (dspec's EAGLE-3 is the variant with all four
false; speculators defaults ``norm_before_residual`` to false and vLLM's reader of this format to
true, so :func:`write` writes every one), and ``speculators_config``. Weights: ``fc``,
``layers.0.{input_layernorm (on the embedding), hidden_norm, self_attn.*, post_attention_layernorm,
mlp.*}``, ``norm``, ``lm_head`` [N, d] (trained), with N < V ``d2t`` [N] / ``t2d`` [V], and the
target's ``embed_tokens`` (speculators' EAGLE-3 loads it from the checkpoint, as its own saves
keep it; on reading it is checked against the target and dropped).
"""

from __future__ import annotations

from dspec_cli import DspecError
from dspec_cli.checkpoints.layouts import (
    VERIFIER_OWNED,
    Converted,
    arch_values,
    dtype_fields,
    foreign_state,
    read_speculators_layers,
    rename_state,
    speculators_config,
    speculators_header,
    speculators_layers,
)
from dspec_eagle3.specforge_layout import OPTIONS, check_t2d, draft_tensors

ARCHITECTURES = ("Eagle3Speculator",)
RULES = (
    ("layers.0.input_layernorm", "embed_norm"),
    ("layers.0.hidden_norm", "hidden_norm"),
    ("layers.0.self_attn", "self_attn"),
    ("layers.0.post_attention_layernorm", "post_attention_layernorm"),
    ("layers.0.mlp", "mlp"),
    ("fc", "fc"),
    ("norm", "norm"),
    ("lm_head", "lm_head"),
    ("d2t", "d2t"),
)
SHARED = ("embed_tokens.weight",)
QK_NORM = {"llama": False, "qwen3": True}  # transformer_layer_config.model_type -> our qk_norm


def read(config: dict, tensors: dict, where: str) -> Converted:
    layers = read_speculators_layers(config, where)
    kind = str(layers.get("model_type", "llama"))
    if kind not in QK_NORM:
        raise DspecError(f"{where}: transformer_layer_config.model_type {kind!r} is not supported (llama, qwen3)")
    if int(layers.get("num_hidden_layers", 1)) != 1:
        raise DspecError(f"{where}: EAGLE-3 with {layers['num_hidden_layers']} decoder layers is not supported (1)")
    for option in OPTIONS:
        if config.get(option):
            raise DspecError(f"{where}: {option} = true is not supported")
    vocab = int(layers.get("vocab_size") or 0)
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    t2d = tensors.pop("t2d", None)
    state, shared = rename_state(tensors, RULES, SHARED, ("rotary_emb", *VERIFIER_OWNED), where)
    d2t = state.pop("d2t", None)
    if draft_vocab < vocab:
        if d2t is None:
            raise DspecError(f"{where}: tensor 'd2t' is missing (draft_vocab_size {draft_vocab} < vocab_size {vocab})")
        state["d2t"] = d2t.long()
        check_t2d(t2d, state["d2t"], vocab, where)
    values = {
        "head_dim": int(layers["hidden_size"]) // int(layers["num_attention_heads"]),  # Llama's default
        **arch_values(layers),
        "num_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab if draft_vocab < vocab else 0,
        "target_layer_ids": [int(j) - 1 for j in aux] if aux else [],  # none: dspec's EAGLE default
        "qk_norm": QK_NORM[kind],
    }
    return Converted(ARCHITECTURES[0], "eagle3", values, state, RULES, shared)


def write(drafter, target) -> tuple[dict, dict]:
    cfg, net = drafter.config, drafter.net
    ids, tensors = draft_tensors(net, cfg.vocab_size)
    config = {
        **speculators_header("eagle3", ARCHITECTURES[0]),
        **dtype_fields(net.dtype),
        "transformer_layer_config": speculators_layers(cfg, target, "qwen3" if cfg.qk_norm else "llama", 1),
        "draft_vocab_size": ids.numel(),
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        **dict.fromkeys(OPTIONS, False),
        "embed_requires_grad": False,
        "speculators_config": speculators_config("eagle3", cfg.block_size, target),
    }
    state = foreign_state(net.state_dict(), RULES)
    if ids.numel() < cfg.vocab_size:  # a reduced draft vocabulary: the maps speculators reads
        state.update(tensors)
    else:
        state.pop("d2t", None)
    # speculators' EAGLE-3 takes the embedding from the checkpoint (its loader fills it from the
    # verifier only when it is missing *and* uninitialised, which from_pretrained never leaves it)
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    return config, state
