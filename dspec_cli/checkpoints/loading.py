"""Loading a drafter by spec, from a checkpoint or the embedded default."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.core.specs import parse_drafter_spec

if TYPE_CHECKING:  # annotations only: checkpoints/ sits below runtime/
    from dspec_cli.runtime.drafter import Drafter
    from dspec_cli.runtime.target import Target

def load_drafter(spec: str, target: Target, checkpoint: str | None, block_size: int) -> Drafter:
    """The one way a drafter is loaded: the drafter ``spec`` (:func:`~dspec_cli.core.specs.parse_drafter_spec`)
    from ``checkpoint`` (a local folder or a Hub id; dspec's layout or a foreign one, see
    :mod:`~dspec_cli.checkpoints.layouts`) or, without one, its default (the embedded drafter)."""
    cls, options = parse_drafter_spec(spec)
    if checkpoint:
        return cls.from_pretrained(resolve_checkpoint(checkpoint), target, block_size=block_size, **options)
    return cls.load_default(target, block_size=block_size, **options)
