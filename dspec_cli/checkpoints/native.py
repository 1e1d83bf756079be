"""dspec's own drafter checkpoint format (docs/checkpoints.md): what ``config.json`` records of
the drafter and its target, the checks that a folder fits a target, and the target a command
loads for its checkpoints.

A drafter checkpoint is a folder: ``config.json`` (:func:`checkpoint_config`, read back as a
:class:`~dspec_cli.checkpoints.config.CheckpointConfig`), ``model.safetensors`` (trainable
weights only), optional ``calibration.json``, ``cost_table.json`` and ``bench.json``, and a
``README.md`` model card (:mod:`dspec_cli.checkpoints.model_card`). :func:`check_fits` validates
a folder against a target. Writing and reading a drafter: :mod:`dspec_cli.checkpoints.persist`.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspec_cli.checkpoints.config import CheckpointConfig
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import (
    CALIBRATION_FILE,
    CONFIG_FILE,
    COST_TABLE_FILE,
    DEFAULT_TARGET_PATH,
    EMBEDDED,
    read_config,
)
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.version import __version__


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, sorted by token) and the sorted special tokens."""
    data = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model, sample: int = 65536) -> str:
    """sha256 over the shapes of all parameters and the first ``sample`` values of the input
    embedding, the output head and the last parameter: tells two checkpoints of one architecture
    apart (e.g. a retrained target under the same name) without reading every weight."""
    h = hashlib.sha256()
    params = list(model.named_parameters())
    for name, p in params:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    picks = [model.get_input_embeddings().weight, model.get_output_embeddings().weight, params[-1][1]]
    for p in picks:
        h.update(p.detach().reshape(-1)[:sample].float().cpu().numpy().tobytes())
    return h.hexdigest()


def target_id(target) -> str:
    """How config.json names a target: "embedded", a Hub id (also for a Hub-cache snapshot), an
    absolute local path, or "" when unknown (a model built in memory)."""
    name = str(getattr(target.model.config, "_name_or_path", "") or "")
    if not name:
        return ""
    cached = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", name)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    path = Path(name)
    if not path.exists():
        return name  # a Hub id that transformers resolved itself
    path = path.resolve()
    return EMBEDDED if path == DEFAULT_TARGET_PATH.resolve() else str(path)


def checkpoint_config(drafter) -> dict[str, Any]:
    """config.json of ``drafter``: name, dspec version, architectures, its target, the chat-template
    kwargs it was trained with (None: not known), its hyper-parameters."""
    target = drafter.target
    info: dict[str, Any] = {"name_or_path": target_id(target), "vocab_size": target.vocab_size,
                            "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers}
    if target.tokenizer is not None:
        info["tokenizer_sha256"] = tokenizer_fingerprint(target.tokenizer)
    arch = "Dspec" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", drafter.name)) + "Drafter"
    return {"drafter": drafter.name, "dspec_version": __version__, "architectures": [arch], "target": info,
            "chat_template_kwargs": drafter.chat_template_kwargs, "drafter_config": drafter.config.to_dict()}


def recorded_target(path: str | Path) -> str | None:
    """The target a dspec checkpoint folder was trained for, as config.json names it ("embedded",
    a Hub id or a local path); None when it names none (foreign layouts, in-memory targets) or the
    folder has no config.json (the loader says what it needs). A dspec config.json that does not
    fit its record is an error here, before any model loads."""
    if not (Path(path) / CONFIG_FILE).is_file():
        return None
    raw = read_config(Path(path))
    if "drafter" not in raw:
        return None  # a foreign layout or a draft model's own config
    return CheckpointConfig.parse(raw, path).target.name_or_path or None


def choose_target(target: str | None, checkpoints: Sequence[str | Path | None]) -> str | None:
    """The target a command loads: ``target`` (--target) when given, else the one the checkpoints
    record (saying so in a warning), else None (the embedded default). Checkpoints recording
    different targets, or a recorded local folder that is gone, are one-line errors."""
    found = {str(c): name for c in checkpoints if c and (name := recorded_target(c))}  # checks each config.json
    if target is not None:
        return target
    names = set(found.values())
    if len(names) > 1:
        listed = ", ".join(f"{c}: {n}" for c, n in found.items())
        raise DspecError(f"the checkpoints were trained for different targets ({listed}); pass --target")
    if not names:
        return None
    name = names.pop()
    where = next(iter(found))
    if name == EMBEDDED:
        return None
    if Path(name).is_absolute() and not Path(name).exists():
        raise DspecError(f"checkpoint {where} was trained for the target at {name}, which no longer exists; "
                         "pass --target PATH|HUB_ID")
    warnings.warn(f"no --target: loading {name}, the target checkpoint {where} was trained for", stacklevel=2)
    return name


_SIZES = (("hidden_size", "hidden size", "hidden_size"), ("vocab_size", "vocabulary size", "vocab_size"),
          ("num_hidden_layers", "target layer count", "num_layers"))


def _trained_for(config: CheckpointConfig) -> str:
    """What to add to a mismatch error: the target config.json names and how to load it ("" if none)."""
    name = config.target.name_or_path
    if not name:
        return ""
    if name == EMBEDDED:
        return " (it was trained for the embedded tiny target: omit --target)"
    return f" (it was trained for {name}: pass --target {name})"


def check_fits(config: CheckpointConfig, name: str, path: Path, target) -> None:
    """One-line errors for a checkpoint (``config`` read from ``path``) of another drafter than
    ``name``, for another target (sizes, tokenizer; naming the target it was trained for), or with
    a malformed calibration.json / cost_table.json."""
    if config.drafter != name:
        raise DspecError(f"checkpoint {path} holds a {config.drafter!r} drafter, not {name!r}")
    # checkpoints written before the target section recorded the sizes in drafter_config only
    stored = {**{k: config.drafter_config.get(k) for k in ("hidden_size", "vocab_size")},
              **config.target.model_dump(exclude_none=True)}
    for key, label, attr in _SIZES:
        got, want = stored.get(key), getattr(target, attr)
        if got and got != want:
            raise DspecError(f"checkpoint {path}: drafter {label} {got} does not match the target's {want}"
                             + _trained_for(config))
    fingerprint = config.target.tokenizer_sha256
    if fingerprint and target.tokenizer is not None:
        mine = tokenizer_fingerprint(target.tokenizer)
        if mine != fingerprint:
            raise DspecError(
                f"checkpoint {path}: the target's tokenizer differs from the drafter's "
                f"(fingerprint {mine[:12]} vs {fingerprint[:12]}): token ids would not match" + _trained_for(config)
            )
    if (path / CALIBRATION_FILE).is_file():
        Calibration.load(path / CALIBRATION_FILE, drafter=name)
    if (path / COST_TABLE_FILE).is_file():
        CostTable.load(path / COST_TABLE_FILE, what="checkpoint cost table")
