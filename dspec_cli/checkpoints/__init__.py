"""Drafter checkpoints: dspec's own format, foreign layouts, the Hub, model cards.

:func:`load_drafter` is the one front door; ``Drafter.from_pretrained`` reads a local folder.
"""

from dspec_cli.checkpoints.loading import load_drafter

__all__ = ["load_drafter"]
