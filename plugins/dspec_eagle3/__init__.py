"""``eagle3``: EAGLE-3 (Li et al., 2025) with optional EAGLE-2 dynamic trees.

One decoder layer reads [norm(embed(x_{t+1})); norm(fc([h_low; h_mid; h_high]_t))] and drafts
autoregressively, feeding its own output hidden state back in place of the target features.
Trained with the training-time test (:mod:`dspec_eagle3.loss`); an optional reduced draft
vocabulary (d2t) maps back to the target's ids with zero probability elsewhere, so
verification stays exact. See docs/drafters/eagle3.md.
"""

from __future__ import annotations

from dspec_cli import hookimpl
from dspec_cli.checkpoints.layouts import Layout
from dspec_eagle3 import specforge_layout, speculators_layout
from dspec_eagle3.drafter import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3State,
    default_layer_ids,
)
from dspec_eagle3.model import Eagle3Net, build_vocab_mapping, ttt_attention_mask

__all__ = [
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Net",
    "Eagle3State",
    "build_vocab_mapping",
    "default_layer_ids",
    "ttt_attention_mask",
]


@hookimpl
def dspec_register_drafters(register):
    register(Eagle3Drafter)


@hookimpl
def dspec_register_layouts(register):
    register(Layout(specforge_layout.ARCHITECTURES[0], specforge_layout.read, specforge_layout.write,
                    lambda d: isinstance(d, Eagle3Drafter)))
    register(Layout(speculators_layout.ARCHITECTURES[0], speculators_layout.read, speculators_layout.write,
                    lambda d: isinstance(d, Eagle3Drafter), family="speculators"))
