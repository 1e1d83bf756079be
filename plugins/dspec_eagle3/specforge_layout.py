"""EAGLE-3 in SpecForge's ``LlamaForCausalLMEagle3`` layout (also read by vLLM and SGLang).

config.json is a Llama config (``num_hidden_layers`` 1) with ``architectures =
["LlamaForCausalLMEagle3"]``, ``vocab_size`` V and ``draft_vocab_size`` N, optionally
``eagle_aux_hidden_state_layer_ids`` (vLLM indexing: id j = output of layer j − 1, 0 =
embeddings; absent = EAGLE's default layers), at the top level (vLLM reads it there) or in
``eagle_config`` (SGLang reads it there; export writes both). Weights: ``embed_tokens`` (frozen copy of the
target's), ``fc`` [d, 3·d], ``midlayer.{input_layernorm (on the embedding), hidden_norm,
self_attn.{q,k,v,o}_proj (q/k/v read 2d; no q/k norms), post_attention_layernorm,
mlp.*}``, ``norm``, ``lm_head`` [N, d] (trained), and with a reduced draft vocabulary (N < V)
``d2t`` [N] (target id = draft id + d2t[draft id]) and ``t2d`` [V] bool (SpecForge
``specforge/modeling/draft/llama3_eagle.py``; vLLM's ``llama_eagle3.py`` has no ``d2t`` parameter
when N = V and refuses one). It loads as our ``eagle3`` with ``qk_norm = false``.
"""

from __future__ import annotations

import torch

from dspec_cli import DspecError
from dspec_cli.checkpoints.layouts import (
    Converted,
    arch_config,
    arch_values,
    dtype_fields,
    foreign_state,
    rename_state,
    require,
)

ARCHITECTURES = ("LlamaForCausalLMEagle3",)
RULES = (
    ("midlayer.input_layernorm", "embed_norm"),
    ("midlayer.hidden_norm", "hidden_norm"),
    ("midlayer.self_attn", "self_attn"),
    ("midlayer.post_attention_layernorm", "post_attention_layernorm"),
    ("midlayer.mlp", "mlp"),
    ("fc", "fc"),
    ("norm", "norm"),
    ("lm_head", "lm_head"),
    ("d2t", "d2t"),
)
SHARED = ("embed_tokens.weight",)
TAPS = 3  # low / mid / high target layers
# EAGLE-3 variants dspec does not compute, written false (vLLM's reader of the speculators format
# defaults norm_before_residual to true)
OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def read(config: dict, tensors: dict, where: str) -> Converted:
    if int(require(config, "num_hidden_layers", where)) != 1:
        raise DspecError(f"{where}: num_hidden_layers must be 1 for EAGLE-3, got {config['num_hidden_layers']}")
    d, V = int(require(config, "hidden_size", where)), int(require(config, "vocab_size", where))
    N = int(config.get("draft_vocab_size") or V)
    if config.get("target_hidden_size") not in (None, d):
        raise DspecError(f"{where}: target_hidden_size {config['target_hidden_size']} differs from hidden_size {d}")
    for option in OPTIONS:
        if config.get(option):
            raise DspecError(f"{where}: {option} = true is not supported")
    nested = config["eagle_config"] if isinstance(config.get("eagle_config"), dict) else {}
    aux = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    t2d = tensors.pop("t2d", None)
    state, shared = rename_state(tensors, RULES, SHARED, (), where)
    d2t = state.pop("d2t", None)
    if N < V:
        if d2t is None:
            raise DspecError(f"{where}: tensor 'd2t' is missing (draft_vocab_size {N} < vocab_size {V})")
        state["d2t"] = d2t.long()
        check_t2d(t2d, state["d2t"], V, where)
    elif d2t is not None and bool(d2t.any()):
        raise DspecError(f"{where}: d2t must be all zero with the full vocabulary (draft_vocab_size = vocab_size)")
    values = {
        "head_dim": d // int(require(config, "num_attention_heads", where)),  # Llama's default
        **arch_values(config),
        "num_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": N if N < V else 0,
        "target_layer_ids": [int(j) - 1 for j in aux] if aux else [],
        "qk_norm": False,
    }
    return Converted(ARCHITECTURES[0], "eagle3", values, state, RULES, shared)


def check_t2d(t2d: torch.Tensor | None, d2t: torch.Tensor, vocab: int, where: str) -> None:
    """t2d [V] bool must mark exactly the target ids d2t maps to (when present)."""
    if t2d is None:
        return
    ids = torch.arange(d2t.numel()) + d2t.cpu()
    want = torch.zeros(vocab, dtype=torch.bool)
    want[ids.clamp(0, vocab - 1)] = True
    if t2d.shape != (vocab,) or not torch.equal(t2d.cpu().bool(), want):
        raise DspecError(f"{where}: t2d does not mark the target ids that d2t maps to")


def write(drafter, target) -> tuple[dict, dict]:
    cfg, net = drafter.config, drafter.net
    if cfg.qk_norm:
        raise DspecError("LlamaForCausalLMEagle3 has no q/k norms: export needs an eagle3 drafter with qk_norm = false")
    if len(cfg.target_layer_ids) != TAPS:
        raise DspecError(f"LlamaForCausalLMEagle3 fuses exactly {TAPS} target layers, this drafter reads "
                         f"{len(cfg.target_layer_ids)}")
    V = cfg.vocab_size
    aux = [i + 1 for i in cfg.target_layer_ids]
    ids, maps = draft_tensors(net, V)
    config = {
        "architectures": list(ARCHITECTURES),
        "model_type": "llama",
        **arch_config(cfg),
        **dtype_fields(net.dtype),
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": ids.numel(),
        "target_hidden_size": cfg.hidden_size,
        **dict.fromkeys(OPTIONS, False),
        "eagle_aux_hidden_state_layer_ids": aux,  # vLLM reads it here,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},  # SGLang here
        "tie_word_embeddings": False,
    }
    tensors = foreign_state(net.state_dict(), RULES)
    tensors.pop("d2t", None)
    if ids.numel() < V:  # the maps of a reduced draft vocabulary; with the full one vLLM has no
        tensors.update(maps)  # parameter for d2t (a load error) and SGLang drafts over every id
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    return config, tensors


def draft_tensors(net, vocab: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The target id of every draft id [N] (N = V for the full vocabulary) and the maps engines read:
    ``d2t`` [N] (target id = draft id + d2t) and ``t2d`` [V] bool (the target ids drafted)."""
    ids = net.draft_ids()
    ids = torch.arange(vocab, device=net.fc.weight.device) if ids is None else ids
    t2d = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return ids, {"d2t": ids - torch.arange(ids.numel(), device=ids.device), "t2d": t2d}
