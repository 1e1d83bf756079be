"""A drafter written to and read from a checkpoint folder: dspec's own format (config.json,
``model.safetensors``, ``calibration.json``; :mod:`~dspec_cli.checkpoints.native`) or, when
reading, another project's layout (:mod:`~dspec_cli.checkpoints.layouts`).

``Drafter.save_pretrained``, ``from_pretrained`` and ``load_default`` delegate here; they take
the drafter class as an argument (:class:`~dspec_cli.checkpoints.config.Checkpointed`), so this
module never imports it. A load reads config.json once, into its record, and checks it against
the target before the drafter is built and its weights are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dspec_cli.checkpoints.config import (
    BlockSizeError,
    CheckpointConfig,
    Checkpointed,
    Trained,
)
from dspec_cli.checkpoints.layouts import load_foreign
from dspec_cli.checkpoints.native import check_fits, checkpoint_config
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import (
    CALIBRATION_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    embedded_path,
    read_config,
)
from dspec_cli.core.outputs import atomic_write_text, write_atomic

if TYPE_CHECKING:  # annotations only: checkpoints/ sits below runtime/
    from dspec_cli.runtime.target import Target

D = TypeVar("D", bound=Checkpointed)
T = TypeVar("T", bound=Trained)


def save_drafter(drafter, path: str | Path, net: torch.nn.Module | None = None) -> None:
    """Write config.json (:func:`~dspec_cli.checkpoints.native.checkpoint_config`), the drafter's
    calibration.json if it has one and, given its trainable weights ``net``, model.safetensors; each
    file atomically, with the mode of a new file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / CONFIG_FILE, json.dumps(checkpoint_config(drafter), indent=2) + "\n")
    if drafter.calibration is not None:
        drafter.calibration.save(path / CALIBRATION_FILE)
    if net is not None:
        state = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
        write_atomic(path / WEIGHTS_FILE, lambda p: save_file(state, str(p)))


def load_config_only(cls: type[D], path: str | Path, target: Target, overrides: dict[str, Any]) -> D:
    """A drafter without weights (``Drafter.from_pretrained``) built from a folder's config.json."""
    path = Path(path)
    config = CheckpointConfig.read(path)
    where = str(path / CONFIG_FILE)
    return cls.build(cls.config_class.from_dict({**config.drafter_config, **overrides}, where=where), target)


def load_trained(cls: type[T], path: str | Path, target: Target, overrides: dict[str, Any]) -> T:
    """A trained drafter (``TrainableDrafter.from_pretrained``) from a checkpoint folder: a foreign
    layout converted in memory, or dspec's own format checked against ``target`` (drafter, sizes,
    tokenizer, block size), its weights, calibration and chat-template kwargs."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    raw = read_config(path)
    if (foreign := load_foreign(cls, path, raw, target, overrides)) is not None:
        return foreign  # another project's layout (DeepSpec, z-lab DFlash, EAGLE-3)
    config = CheckpointConfig.parse(raw, path)
    check_fits(config, cls.name, path, target)
    config.check_trained_block_size(overrides.get("block_size"), path)
    values = {**config.drafter_config, **overrides}
    drafter = cls.build(cls.config_class.from_dict(values, where=str(path / CONFIG_FILE)), target)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise DspecError(f"checkpoint {path}: {WEIGHTS_FILE} is missing")
    try:
        state = load_file(str(weights), device=str(target.device))
    except (SafetensorError, OSError) as exc:
        raise DspecError(f"checkpoint {path}: {WEIGHTS_FILE} is corrupt ({exc})") from None
    _load_weights(drafter.net, state, path, cls.name)
    if (path / CALIBRATION_FILE).is_file():  # validated by check_fits
        drafter.calibration = Calibration.load(path / CALIBRATION_FILE, drafter=cls.name)
    drafter.chat_template_kwargs = config.chat_template_kwargs
    return drafter


def trained_weights(cls: type[T], path: Path, target: Target, where: str) -> dict[str, torch.Tensor]:
    """The trainable weights a checkpoint folder holds for a ``cls`` drafter (fine-tuning's start):
    a foreign layout converted in memory (frozen copies checked), or dspec's own format checked
    against ``target``; one-line errors starting with ``where`` (e.g. ``--init-from PATH``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw = read_config(path)
    if (foreign := load_foreign(cls, path, raw, target, {})) is not None:
        return foreign.net.state_dict()
    check_fits(CheckpointConfig.parse(raw, path), cls.name, path, target)
    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise DspecError(f"{where}: cannot read {WEIGHTS_FILE} ({exc})") from None


def load_embedded(cls: type[D], target: Target, overrides: dict[str, Any]) -> D:
    """The embedded checkpoint ``assets/drafters/<name>/`` of a trained drafter (``load_default``),
    loaded through the class's own ``from_pretrained``; one-line errors when none is embedded, the
    block size exceeds the one it was trained with, or it does not fit ``target``."""
    path = embedded_path("drafters") / cls.name
    if not (path / CONFIG_FILE).is_file():
        raise DspecError(f"no trained {cls.name} drafter is embedded; {_train_hint(cls)}")
    try:
        return cls.from_pretrained(path, target, **overrides)
    except BlockSizeError:
        raise  # it fits; the block size asked for does not
    except DspecError as exc:
        raise DspecError(f"the embedded {cls.name} drafter does not fit this target ({exc}); {_train_hint(cls)}") from None


def _train_hint(cls: type[D]) -> str:
    return f"train one with `dspec train --drafter {cls.name} --recipe RECIPE` or pass --checkpoint PATH"


def _load_weights(net: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, name: str) -> None:
    """``state`` into ``net``, with one-line errors for tensors that are missing, extra or of another size."""
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # size mismatch
        detail = str(exc).strip().splitlines()[-1].strip()
        raise DspecError(f"checkpoint {path}: weights do not fit drafter {name!r} ({detail})") from None
    if missing or unexpected:
        raise DspecError(
            f"checkpoint {path}: weights do not match drafter {name!r} "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
