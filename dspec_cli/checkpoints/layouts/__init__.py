"""Foreign checkpoint layouts: load other projects' drafter checkpoints, write them for export.

Each layout is a :class:`Layout`, registered by the plugin that owns the drafter through the
``dspec_register_layouts`` hook (docs/plugins.md, docs/interop.md); the built-in ones:
DeepSpec's ``Qwen3DSparkModel`` / ``Gemma4DSparkModel`` and z-lab's ``DFlashDraftModel``
(``dspec_dflash``), SpecForge's ``LlamaForCausalLMEagle3`` (``dspec_eagle3``) — the layouts the
engines load (family ``engines``) — and vllm-project/speculators' ``DFlashSpeculator`` /
``DSparkSpeculator`` (``dspec_dflash``) and ``Eagle3Speculator`` (``dspec_eagle3``), family
``speculators``.

A folder is foreign when its config.json has no ``"drafter"`` key (ours always has one) and
names an ``architectures`` entry. :func:`load_foreign` is the one hook in the loader of trained
drafters (:func:`~dspec_cli.checkpoints.persist.load_trained`): it converts in memory (no files written), checks the
frozen embedding / LM head copies against the target's (our checkpoints hold trainable weights
only) and loads the weights, failing in one line that names the foreign tensor or field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dspec_cli.checkpoints.config import Trained
from dspec_cli.checkpoints.layouts.common import (
    ARCH_FIELDS,
    Converted,
    Rules,
    arch_config,
    arch_values,
    dtype_fields,
    foreign_state,
    read_tensors,
    rename,
    rename_state,
    require,
    save,
    value,
)
from dspec_cli.checkpoints.layouts.speculators import (
    VERIFIER_OWNED,
    read_speculators_layers,
    speculators_config,
    speculators_header,
    speculators_layers,
)
from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import read_config

if TYPE_CHECKING:  # annotations only: checkpoints/ sits below runtime/
    from dspec_cli.runtime.target import Target

D = TypeVar("D", bound=Trained)

__all__ = [
    "ARCH_FIELDS", "Converted", "Layout", "Rules", "arch_config", "arch_values", "checkpoint_drafter", "convert",
    "detect_layout", "dtype_fields", "export_layout", "foreign_state", "layouts", "load_foreign", "read_tensors",
    "rename", "rename_state", "require", "save", "to_foreign", "value", "write",
    "VERIFIER_OWNED", "read_speculators_layers", "speculators_config", "speculators_header", "speculators_layers",
]


@dataclass(frozen=True)
class Layout:
    """One foreign checkpoint layout, named by its config.json ``architectures[0]``."""

    architecture: str
    read: Callable[[dict, dict, str], Converted]  # (config, tensors, where) -> our names
    write: Callable[[Any, Any], tuple[dict, dict]]  # (drafter, target) -> (config, tensors)
    exports: Callable[[Any], bool]  # whether this is the layout a drafter is exported in (within its family)
    family: str = "engines"  # the export formats it is written for: "engines" (vllm, sglang) or "speculators"


def layouts() -> dict[str, Layout]:
    """Every registered layout by architecture (plugins' ``dspec_register_layouts``)."""
    return {layout.architecture: layout for layout in plugins.registry().layouts}


_SHARED_ROLE = {"embed_tokens.weight": "input embedding", "lm_head.weight": "LM head"}


def detect_layout(config: dict) -> str | None:
    """The foreign architecture of a config.json dict; None for ours (it has ``"drafter"``) or a
    config without ``architectures``; DspecError for an architecture no layout reads."""
    archs = config.get("architectures")
    if "drafter" in config or not isinstance(archs, list) or not archs:
        return None
    known = layouts()
    if archs[0] not in known:
        raise DspecError(
            f"architecture {archs[0]!r} is not a layout dspec can load (supported: {', '.join(known) or 'none'})"
        )
    return archs[0]


def _layout(config: dict, folder: str | Path) -> str | None:
    """:func:`detect_layout` with the folder named in its error."""
    try:
        return detect_layout(config)
    except DspecError as exc:
        raise DspecError(f"checkpoint {folder}: {exc}") from None


def convert(folder: str | Path, config: dict | None = None) -> Converted:
    """Read a foreign checkpoint folder (its config.json ``config`` when already read) into our
    names (DspecError if it is not one)."""
    folder = Path(folder)
    config = read_config(folder) if config is None else config
    layout = _layout(config, folder)
    if layout is None:
        raise DspecError(f"checkpoint {folder}: not a foreign layout (dspec's own, or no 'architectures')")
    where = f"checkpoint {folder} ({layout})"
    return layouts()[layout].read(config, read_tensors(folder, where), where)


def checkpoint_drafter(folder: str | Path) -> str:
    """The drafter name a checkpoint folder holds (ours: config.json's "drafter"; foreign: converted)."""
    config = read_config(Path(folder))
    if _layout(config, folder) is not None:
        return convert(folder, config).drafter
    if not isinstance(config.get("drafter"), str):
        raise DspecError(f"checkpoint {folder}: config.json names no drafter")
    return config["drafter"]


def load_foreign(cls: type[D], path: Path, config: dict, target: Target, overrides: dict[str, Any]) -> D | None:
    """The loading hook: a drafter built from the foreign checkpoint ``path`` (its config.json
    ``config``), or None if it is not one."""
    if _layout(config, path) is None:
        return None
    conv = convert(path, config)
    where = f"checkpoint {path} ({conv.layout})"
    if conv.drafter != cls.name:
        raise DspecError(f"{where} holds a {conv.drafter!r} drafter, not {cls.name!r}")
    if conv.num_target_layers not in (None, target.num_layers):
        raise DspecError(f"{where}: trained for a target with {conv.num_target_layers} layers, "
                         f"this target has {target.num_layers} (pass the --target it was trained for)")
    try:
        drafter = cls.build(cls.config_class.from_dict({**conv.config, **overrides}, where="config.json"), target)
    except DspecError as exc:
        raise DspecError(f"{where}: {exc}") from None
    _check_shared(conv.shared, target, where)
    _load_state(drafter.net, conv, where)
    return drafter


def _check_shared(shared: dict[str, torch.Tensor], target: Target, where: str) -> None:
    """Frozen copies must equal the target's weights (up to the checkpoint's precision)."""
    modules = {"embed_tokens.weight": target.model.get_input_embeddings(),
               "lm_head.weight": target.model.get_output_embeddings()}
    for name, theirs in shared.items():
        mine = modules[name].weight.detach()
        role = _SHARED_ROLE[name]
        if theirs.shape != mine.shape:
            raise DspecError(f"{where}: {name} has shape {list(theirs.shape)}, the target's {role} "
                             f"{list(mine.shape)}")
        if not _close(theirs, mine):
            raise DspecError(f"{where}: {name} differs from the target's {role} (trained for another target?)")


def _close(theirs: torch.Tensor, mine: torch.Tensor, rows: int = 8192) -> bool:
    """Equal after rounding ours to their dtype, within 1% of the largest entry; chunked."""
    scale = 1e-2 * float(theirs.abs().max()) + 1e-6
    for start in range(0, theirs.shape[0], rows):
        a = theirs[start:start + rows].float()
        b = mine[start:start + rows].to(device="cpu", dtype=theirs.dtype).float()
        if float((a - b).abs().max()) > scale:
            return False
    return True


def _load_state(net: torch.nn.Module, conv: Converted, where: str) -> None:
    """Strict load with one-line errors in the foreign layout's tensor names."""
    own = net.state_dict()
    foreign = lambda name: rename(name, conv.rules, reverse=True) or name  # noqa: E731
    for name in own:
        if name not in conv.state:
            raise DspecError(f"{where}: tensor {foreign(name)!r} is missing")
    for name, tensor in conv.state.items():
        if name not in own:
            raise DspecError(f"{where}: unexpected tensor {foreign(name)!r} for this configuration")
        if tensor.shape != own[name].shape:
            raise DspecError(f"{where}: tensor {foreign(name)!r} has shape {list(tensor.shape)}, "
                             f"the configuration needs {list(own[name].shape)}")
    net.load_state_dict(conv.state)


def export_layout(drafter, family: str = "engines") -> str:
    """The foreign architecture of ``family`` that :func:`write` uses for ``drafter`` (DspecError if none)."""
    known = {arch: layout for arch, layout in layouts().items() if layout.family == family}
    found = [arch for arch, layout in known.items() if layout.exports(drafter)]
    if not found:
        exportable = ", ".join(sorted(known)) or "none"
        raise DspecError(f"drafter {drafter.name!r} has no foreign checkpoint layout (layouts: {exportable})")
    return found[0]


def to_foreign(drafter, target: Target, family: str = "engines") -> tuple[str, dict, dict]:
    """(architecture, config.json dict, tensors) of ``drafter`` in its foreign layout of ``family``,
    in the drafter's dtype (load the target with the dtype wanted)."""
    layout = export_layout(drafter, family)
    config, tensors = layouts()[layout].write(drafter, target)
    return layout, config, tensors


def write(drafter, target: Target, folder: str | Path) -> str:
    """Save ``drafter`` in its foreign layout into ``folder``; returns the architecture."""
    layout, config, tensors = to_foreign(drafter, target)
    save(Path(folder), config, tensors)
    return layout
