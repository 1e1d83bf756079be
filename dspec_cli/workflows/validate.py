"""``dspec push``'s check: a checkpoint folder loads against its target exactly as bench would."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from dspec_cli.checkpoints import load_drafter
from dspec_cli.checkpoints.config import CheckpointConfig
from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import EMBEDDED
from dspec_cli.core.hardware import SlowHalfPrecision
from dspec_cli.runtime.target import Target


def validate_checkpoint(path: Path, target: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Load the checkpoint in ``path`` against its target (``target``, else the one config.json
    names, else the embedded one) exactly as bench would; return its config."""
    path = Path(path)
    # no folder (named as such), a config.json that does not fit and an unknown drafter fail before the target loads
    config = CheckpointConfig.read(path)
    plugins.get_drafter_class(config.drafter)
    name = target or config.target.name_or_path
    try:
        with warnings.catch_warnings():  # loaded to check shapes only: no matmul speed concern
            warnings.simplefilter("ignore", SlowHalfPrecision)
            tgt = Target.load(None if name in (None, "", EMBEDDED) else name, dtype="bfloat16", device=device)
    except DspecError as exc:
        raise DspecError(f"{exc} (pass --target to validate against another copy of the target)") from None
    load_drafter(config.drafter, tgt, path)
    return config.model_dump(mode="json")
