"""``dspark-markov`` (alias ``dspark``) and ``dspark-rnn``: DSpark's semi-autoregressive drafters.

The DFlash backbone (anchor = first prediction position) runs one parallel forward; a light
sequential head then samples the block left to right, adding a bias that depends on the
previously sampled token (Markov, rank r: U_k + W2·W1[x_{k−1}]) or on the whole block prefix
(gated RNN, paper eq. 6). A confidence head c_k = σ(w·[h_k; W1[x_{k−1}]]) (optionally with
per-position temperatures from the checkpoint's ``calibration.json``) rides along in every
proposal for the scheduler; it never looks at x_k. The proposer is :mod:`dspec_dspark.drafter`;
the backbone, caches and training are dflash's shared block drafter. Training: 0.1·CE + 0.9·L1(p_d, p_t) +
1.0·BCE(c_k, 1 − TV_k), position-weighted exp(−k/4).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspec_dflash import BlockDrafterConfig

from dspec_cli import Capability, DspecError, hookimpl
from dspec_dspark.drafter import DSparkDrafter

__all__ = ["DSparkDrafter", "DSparkMarkovConfig", "DSparkMarkovDrafter", "DSparkRNNConfig", "DSparkRNNDrafter"]


@dataclass
class DSparkMarkovConfig(BlockDrafterConfig):
    """DeepSpec's DSpark defaults: Markov head of rank 256, confidence head, 0.1/0.9/1.0 losses."""

    head: str = "markov"
    markov_rank: int = 256
    confidence_head: bool = True
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head not in ("markov", "rnn"):
            raise DspecError(f"DSpark's sequential head is markov or rnn, got {self.head!r} (dflash has none)")


@dataclass
class DSparkRNNConfig(DSparkMarkovConfig):
    """DSpark with the gated RNN head (state size = markov_rank)."""

    head: str = "rnn"


class DSparkMarkovDrafter(DSparkDrafter):
    name = "dspark-markov"
    config_class = DSparkMarkovConfig
    capabilities = frozenset({Capability.draft_probs, Capability.confidence, Capability.marginals, Capability.trainable})
    description = "DSpark: parallel backbone + low-rank Markov head + confidence head"


class DSparkRNNDrafter(DSparkDrafter):
    name = "dspark-rnn"
    config_class = DSparkRNNConfig
    capabilities = frozenset({Capability.draft_probs, Capability.confidence, Capability.marginals, Capability.trainable})
    description = "DSpark: parallel backbone + gated RNN head + confidence head"


@hookimpl
def dspec_register_drafters(register):
    register(DSparkMarkovDrafter, aliases=("dspark",))
    register(DSparkRNNDrafter)
