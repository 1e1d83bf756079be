"""``dflash``: parallel block drafter with KV injection of fused target features (DFlash).

Qwen3-style decoder layers read the target's hidden taps of the committed context as extra
keys/values in every layer (:mod:`dspec_cli.nn.backbone`); one forward drafts a whole block of
γ tokens, each slot sampled independently at the run's temperature (q_k goes into the
proposal, so verification is lossless rejection sampling). Uses DeepSpec's block layout:
the anchor slot is the first prediction position (γ inputs -> γ drafts); see
:mod:`dspec_dflash.drafter`. The DSpark drafters (``dspec_dspark``) subclass it with their own
proposer.
"""

from __future__ import annotations

from dspec_cli import hookimpl
from dspec_cli.checkpoints.layouts import Layout
from dspec_dflash import deepspec_layout, speculators_layout, zlab_layout
from dspec_dflash.drafter import (
    BlockDrafterConfig,
    BlockDraftState,
    DFlashConfig,
    DFlashDrafter,
)

__all__ = ["BlockDraftState", "BlockDrafterConfig", "DFlashConfig", "DFlashDrafter"]


@hookimpl
def dspec_register_drafters(register):
    register(DFlashDrafter)


def _deepspec_exports(style: str):
    # dflash with a non-predicting anchor slot is z-lab's layout; every other block drafter
    # (dflash, dspark-markov, dspark-rnn) exports as DeepSpec's model of its layer style
    return lambda d: (isinstance(d, DFlashDrafter) and d.config.layer_style == style
                      and (d.config.anchor_predicts or type(d) is not DFlashDrafter))


@hookimpl
def dspec_register_layouts(register):
    for arch, style in deepspec_layout.STYLES.items():
        register(Layout(arch, deepspec_layout.read, deepspec_layout.write, _deepspec_exports(style)))
    register(Layout(zlab_layout.ARCHITECTURES[0], zlab_layout.read, zlab_layout.write,
                    lambda d: type(d) is DFlashDrafter and not d.config.anchor_predicts))
    for arch in speculators_layout.ARCHITECTURES:
        register(Layout(arch, speculators_layout.read, speculators_layout.write, speculators_layout.exports(arch),
                        family="speculators"))
