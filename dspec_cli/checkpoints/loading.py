"""Loading a drafter by spec, from a checkpoint or the embedded default."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.checkpoints.layouts import checkpoint_drafter
from dspec_cli.core.specs import parse_drafter_spec

if TYPE_CHECKING:  # annotations only: checkpoints/ sits below runtime/
    from dspec_cli.runtime.drafter import Drafter
    from dspec_cli.runtime.target import Target


def load_drafter(spec: str | None, target: Target, checkpoint: str | Path | None = None,
                 block_size: int | None = None) -> Drafter:
    """The one way a drafter is loaded: the drafter ``spec`` (:func:`~dspec_cli.core.specs.parse_drafter_spec`)
    from ``checkpoint`` (a local folder or a Hub id; dspec's layout or a foreign one, see
    :mod:`~dspec_cli.checkpoints.layouts`) or, without one, its default (the embedded drafter).

    ``spec`` None: the drafter the checkpoint holds. ``block_size`` None: the checkpoint's (or
    the default drafter's) own γ.
    """
    path = resolve_checkpoint(checkpoint) if checkpoint else None
    if spec is None:
        if path is None:
            raise ValueError("load_drafter needs a drafter spec or a checkpoint")
        spec = checkpoint_drafter(path)
    cls, options = parse_drafter_spec(spec)
    if block_size is not None:
        options["block_size"] = block_size
    if path is not None:
        return cls.from_pretrained(path, target, **options)
    return cls.load_default(target, **options)
