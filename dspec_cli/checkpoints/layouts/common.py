"""Pieces shared by the foreign-layout modules: files, name rules, config fields.

A layout module describes one foreign checkpoint layout with

* ``ARCHITECTURES``: the ``architectures[0]`` values it reads;
* ``RULES``: (foreign prefix, our prefix) pairs that rename tensors both ways;
* ``read(config, tensors, where) -> Converted``;
* ``write(drafter, target) -> (config, tensors)`` for export (DspecError if the drafter does
  not fit the layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CONFIG_FILE, WEIGHTS_FILE
from dspec_cli.core.outputs import write_atomic

Rules = tuple[tuple[str, str], ...]

# Architecture fields of a Qwen3/Llama-style config.json that map 1:1 onto BackboneConfig.
ARCH_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "attention_bias", "initializer_range",
)
INDEX_FILE = "model.safetensors.index.json"  # sharded weights (transformers' save_pretrained)


@dataclass
class Converted:
    """A foreign checkpoint in our terms (no files written)."""

    layout: str  # the foreign architecture, e.g. "Qwen3DSparkModel"
    drafter: str  # our drafter name
    config: dict[str, Any]  # DrafterConfig values
    state: dict[str, torch.Tensor]  # our parameter name -> tensor
    rules: Rules  # to name a tensor in the foreign layout in messages
    shared: dict[str, torch.Tensor] = field(default_factory=dict)  # foreign name -> frozen copy of the target's
    num_target_layers: int | None = None  # the target the checkpoint was trained for, when recorded


def read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards listed in model.safetensors.index.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / INDEX_FILE
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS_FILE]
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
        raise DspecError(f"{where}: {INDEX_FILE} is unreadable ({exc})") from None
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise DspecError(f"{where}: {name} is missing")
        try:
            tensors.update(load_file(str(folder / name)))
        except (SafetensorError, OSError) as exc:
            raise DspecError(f"{where}: {name} is corrupt ({exc})") from None
    return tensors


def save(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors of tensors (name -> tensor [any shape]; a tensor seen
    twice, e.g. a tied LM head, is copied)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        state[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    write_atomic(folder / WEIGHTS_FILE, lambda p: save_file(state, str(p), metadata={"format": "pt"}))


def value(config: dict, key: str, default: Any = None) -> Any:
    """An algorithm field: ``dflash_config[key]``, else the top-level key (vLLM's lookup order)."""
    nested = config.get("dflash_config")
    if isinstance(nested, dict) and key in nested:
        return nested[key]
    return config.get(key, default)


def require(config: dict, key: str, where: str) -> Any:
    found = value(config, key)
    if found is None:
        raise DspecError(f"{where}: config.json has no {key!r}")
    return found


def rename(name: str, rules: Rules, reverse: bool = False) -> str | None:
    """Apply the first rule whose prefix matches ``name`` (whole dotted components); None if none."""
    for foreign, ours in rules:
        src, dst = (ours, foreign) if reverse else (foreign, ours)
        if name == src or name.startswith(src + "."):
            return dst + name[len(src):]
    return None


def rename_state(
    tensors: dict[str, torch.Tensor], rules: Rules, shared: tuple[str, ...], ignored: tuple[str, ...], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Foreign tensors (name -> tensor [any shape]) -> (our state, the shared frozen copies);
    unknown names are an error."""
    state, frozen = {}, {}
    for name, tensor in tensors.items():
        if name in shared:
            frozen[name] = tensor
        elif (ours := rename(name, rules)) is not None:
            state[ours] = tensor
        elif not any(name == p or name.startswith(p + ".") for p in ignored):
            raise DspecError(f"{where}: unexpected tensor {name!r}")
    return state, frozen


def arch_values(config: dict) -> dict[str, Any]:
    """BackboneConfig fields from a foreign config.json (absent ones are copied from the target)."""
    out = {k: config[k] for k in ARCH_FIELDS if config.get(k) is not None}
    rope = config.get("rope_parameters")
    if not (isinstance(rope, dict) and "rope_type" in rope):  # transformers 4 style: rope_theta + rope_scaling
        scaling = dict(config.get("rope_scaling") or {})
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        rope = {"rope_type": kind, **scaling, "rope_theta": config["rope_theta"]} if "rope_theta" in config else None
    if rope:
        out["rope_parameters"] = dict(rope)
    return out


def arch_config(cfg) -> dict[str, Any]:
    """The reverse of :func:`arch_values` for a resolved config, with RoPE in every spelling the
    engines read: ``rope_parameters`` (transformers 5, vLLM), ``rope_theta`` + ``rope_scaling``
    (transformers 4 and SGLang's model code; null for plain RoPE) and a top-level
    ``partial_rotary_factor`` when the parameters carry one."""
    out = {k: getattr(cfg, k) for k in ARCH_FIELDS}
    rope = dict(cfg.rope_parameters)
    out["rope_parameters"] = rope
    out["rope_theta"] = rope.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor") and v is not None}
    out["rope_scaling"] = scaling if rope.get("rope_type", "default") != "default" else None
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return out


def dtype_fields(dtype: torch.dtype) -> dict[str, str]:
    name = str(dtype).replace("torch.", "")
    return {"dtype": name, "torch_dtype": name}


def foreign_state(state: dict[str, torch.Tensor], rules: Rules) -> dict[str, torch.Tensor]:
    """Our state dict (name -> tensor [any shape], kept as is) renamed into a foreign layout;
    a name no rule covers is a ValueError."""
    out = {}
    for name, tensor in state.items():
        foreign = rename(name, rules, reverse=True)
        if foreign is None:
            raise ValueError(f"no layout rule names parameter {name!r}")
        out[foreign] = tensor
    return out
