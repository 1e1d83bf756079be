"""``dflash``: parallel block drafter with KV injection of fused target features (DFlash).

Qwen3-style decoder layers read the target's hidden taps of the committed context as extra
keys/values in every layer (:mod:`dspec_cli.backbone`); one forward drafts a whole block of
γ tokens, each slot sampled independently at the run's temperature (q_k goes into the
proposal, so verification is lossless rejection sampling). Uses DeepSpec's block layout:
the anchor slot is the first prediction position (γ inputs -> γ drafts); see
:mod:`dspec_dflash.drafter`. The DSpark drafters (``dspec_dspark``) reuse this class.
"""

from __future__ import annotations

from dspec_cli import hookimpl
from dspec_dflash.drafter import BlockDrafterConfig, BlockDraftState, DFlashConfig, DFlashDrafter

__all__ = ["BlockDraftState", "BlockDrafterConfig", "DFlashConfig", "DFlashDrafter"]


@hookimpl
def dspec_register_drafters(register):
    register(DFlashDrafter)
