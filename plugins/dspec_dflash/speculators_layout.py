"""vllm-project/speculators: ``DFlashSpeculator`` / ``DSparkSpeculator`` checkpoints of dflash and
the DSpark drafters (speculators ``speculators/models/dflash`` and ``speculators/models/dspark``).

config.json: ``speculators_model_type`` (``dflash`` / ``dspark``), ``transformer_layer_config``
(a Qwen3 config of the draft layers: sizes, RoPE, ``num_hidden_layers`` = draft layers,
``vocab_size`` = the target's), ``draft_vocab_size`` (must equal the vocabulary here),
``block_size`` (input slots, anchor included), ``sample_from_anchor`` (true: the anchor slot
predicts, γ = block_size, DeepSpec's block; false: only the masks predict, γ = block_size − 1,
z-lab's), ``aux_hidden_state_layer_ids`` (vLLM indexing: id j = output of layer j − 1, so ours
+ 1), ``mask_token_id``; DSpark adds ``markov_rank``, ``markov_head_type`` (vanilla / rnn; gated
is refused), ``enable_confidence_head`` and ``confidence_head_with_markov``; and
``speculators_config`` (algorithm, the greedy proposal's ``speculative_tokens`` = γ, the verifier's
``name_or_path`` and ``architectures``). Weights: ``fc``, ``hidden_norm``, ``layers.*``, ``norm``,
``markov_head.markov_w1`` / ``markov_w2`` / ``joint_proj``, ``confidence_head.proj`` — DeepSpec's
names — without the embedding and LM head, which speculators fills from the verifier (a copy that is
there is checked against the target).

Defaults differ between the libraries that read this format (speculators' DSpark config defaults
``sample_from_anchor`` to true, vLLM's reader of it to false; speculators defaults
``confidence_head_with_markov`` to true; ``sliding_window_non_causal`` false means nothing to
speculators' full-attention layers but a causal block to vLLM), so :func:`write` writes every
such field.
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
from dspec_dflash.deepspec_layout import HEADS, RULES, check_layer_types

ARCHITECTURES = ("DFlashSpeculator", "DSparkSpeculator")
TYPES = {"DFlashSpeculator": "dflash", "DSparkSpeculator": "dspark"}
SHARED = ("embed_tokens.weight", "lm_head.weight")
IGNORED = ("rotary_emb", *VERIFIER_OWNED, "t2d", "d2t")  # vocabulary maps: none is used with the full vocabulary


def _get(config: dict, key: str, where: str):
    if config.get(key) is None:
        raise DspecError(f"{where}: config.json has no {key!r}")
    return config[key]


def read(config: dict, tensors: dict, where: str) -> Converted:
    arch = config["architectures"][0]
    kind = config.get("speculators_model_type", TYPES[arch])
    if kind != TYPES[arch]:
        raise DspecError(f"{where}: speculators_model_type {kind!r} does not match {arch}")
    layers = read_speculators_layers(config, where)
    check_layer_types(layers, where)
    vocab = int(_get(layers, "vocab_size", where))
    if int(config.get("draft_vocab_size") or vocab) != vocab:
        raise DspecError(f"{where}: draft_vocab_size {config['draft_vocab_size']} < vocab_size {vocab}: reduced "
                         "draft vocabularies are not supported for block drafters")
    anchor = bool(config.get("sample_from_anchor", kind == "dspark"))  # speculators' defaults
    block = int(_get(config, "block_size", where))
    rank = int(config.get("markov_rank", 256 if kind == "dspark" else 0) or 0)
    head_kind = str(config.get("markov_head_type", "vanilla"))
    if rank and head_kind not in HEADS:
        raise DspecError(f"{where}: markov_head_type {head_kind!r} is not supported (dspec has {', '.join(HEADS)})")
    if rank and not anchor:
        raise DspecError(f"{where}: DSpark with sample_from_anchor = false (the anchor as a bonus token) is not supported")
    confidence = kind == "dspark" and bool(config.get("enable_confidence_head", True))
    if confidence and bool(config.get("confidence_head_with_markov", True)) != bool(rank):
        raise DspecError(f"{where}: a confidence head must read the Markov features exactly when markov_rank > 0")
    drafter, head = HEADS[head_kind] if rank else ("dflash", "none")
    values = {
        **arch_values(layers),
        "layer_style": "qwen3",
        "num_layers": int(_get(layers, "num_hidden_layers", where)),
        "vocab_size": vocab,
        "block_size": block if anchor else block - 1,
        "anchor_predicts": anchor,
        "target_layer_ids": [int(j) - 1 for j in _get(config, "aux_hidden_state_layer_ids", where)],
        "mask_token_id": int(_get(config, "mask_token_id", where)),
        "head": head,
        "markov_rank": rank,
        "confidence_head": confidence,
    }
    if values["block_size"] < 1:
        raise DspecError(f"{where}: block_size {block} leaves no draft slot")
    state, shared = rename_state(tensors, RULES, SHARED, IGNORED, where)
    return Converted(arch, drafter, values, state, RULES, shared)


def exports(arch: str):
    """Whether a drafter is written as ``arch``: dflash as DFlashSpeculator, the DSpark drafters as
    DSparkSpeculator (the export refuses other layer styles)."""
    names = ("dflash",) if TYPES[arch] == "dflash" else ("dspark-markov", "dspark-rnn")
    return lambda d: d.name in names


def write(drafter, target) -> tuple[dict, dict]:
    cfg = drafter.config
    if cfg.layer_style != "qwen3":
        raise DspecError(f"speculators' DFlash / DSpark draft layers are Qwen3's, not {cfg.layer_style!r} ones")
    dspark = drafter.name != "dflash"
    kind = "dspark" if dspark else "dflash"
    anchor = bool(cfg.anchor_predicts)
    if dspark and not anchor:
        raise DspecError("DSpark in speculators' format needs the anchor slot to predict (anchor_predicts = true)")
    config = {
        **speculators_header(kind, next(a for a, t in TYPES.items() if t == kind)),
        **dtype_fields(drafter.net.backbone.dtype),
        "transformer_layer_config": speculators_layers(cfg, target, "qwen3", cfg.num_layers),
        "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": target.hidden_size,
        "block_size": cfg.block_size if anchor else cfg.block_size + 1,
        "sample_from_anchor": anchor,
        # speculators applies it to sliding-window layers only (none here); vLLM's reader makes every
        # layer's block causal unless it is true, so true keeps the block bidirectional in both
        "sliding_window_non_causal": True,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "speculators_config": speculators_config(kind, cfg.block_size, target),
    }
    if dspark:
        rank = cfg.markov_rank
        config.update(markov_rank=rank, markov_head_type={ours: k for k, (_, ours) in HEADS.items()}[cfg.head],
                      enable_confidence_head=bool(cfg.confidence_head),
                      confidence_head_with_markov=bool(cfg.confidence_head) and bool(rank))
    return config, foreign_state(drafter.net.state_dict(), RULES)
