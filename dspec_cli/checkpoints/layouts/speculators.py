"""Pieces of vllm-project/speculators' checkpoint format shared by the layouts that write it
(``speculators/config.py``: ``SpeculatorModelConfig``, ``SpeculatorsConfig``, ``VerifierConfig``;
``speculators/proposals/greedy.py``). A speculators config.json holds ``speculators_model_type``,
``speculators_version``, the draft layers as a transformers config (``transformer_layer_config``)
and ``speculators_config``: the algorithm, its token proposals and the verifier (the target) by
``name_or_path`` and ``architectures``. Weights the verifier supplies (embedding, and the LM head of
a full-vocabulary draft) are not saved; ``verifier_*`` buffers and vocabulary maps of a full
vocabulary may appear and are ignored on reading."""

from __future__ import annotations

from typing import Any

from dspec_cli.checkpoints.layouts.common import arch_config
from dspec_cli.core.errors import DspecError

FORMAT_VERSION = "0.9.0"  # the speculators release whose format is written
VERIFIER_OWNED = ("verifier_norm", "verifier_lm_head")  # tensors speculators rebuilds from the target


def speculators_config(algorithm: str, tokens: int, target) -> dict[str, Any]:
    """``speculators_config``: one greedy proposal of ``tokens`` drafts per round, and the verifier
    (the target's ``name_or_path``, as loaded: a Hub id or a path)."""
    name = str(getattr(target.model.config, "name_or_path", "") or "") or None
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": name, "architectures": list(getattr(target.model.config, "architectures", None) or [])},
    }


def speculators_layers(cfg, target, model_type: str, layers: int) -> dict[str, Any]:
    """``transformer_layer_config``: the draft layers (a resolved BackboneConfig ``cfg``) as a
    transformers config of ``model_type`` over the target's vocabulary."""
    return {"model_type": model_type, **arch_config(cfg), "vocab_size": target.vocab_size, "num_hidden_layers": layers,
            "layer_types": ["full_attention"] * layers, "tie_word_embeddings": False}


def speculators_header(kind: str, architecture: str) -> dict[str, Any]:
    """The fields that name a speculators checkpoint: architecture, model type, format version."""
    return {"architectures": [architecture], "speculators_model_type": kind, "speculators_version": FORMAT_VERSION}


def read_speculators_layers(config: dict, where: str) -> dict:
    """The ``transformer_layer_config`` object of a speculators config.json."""
    layers = config.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise DspecError(f"{where}: config.json has no transformer_layer_config object")
    return layers
