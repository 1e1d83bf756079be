"""``ddtree``: DDTree (Ringel & Romano) — a best-first draft tree over a parallel drafter.

One parallel forward of a ``marginals`` drafter (``dflash``; new here: ``dspark-markov`` and
``dspark-rnn``, whose children are conditioned on their parent's token by the sequential head)
gives per-position distributions; the ``tree_budget`` most probable prefixes form the tree,
which the target verifies in one pass with an ancestor mask (``verify_tree``, sample-and-match:
lossless at every temperature). With ``tree_mode="sampled"`` (the default, T > 0) the children
are sampled without replacement from the run's q instead, in a static shape chosen from per-rank
acceptance rates, and verified with q (``"sampled"``).
See docs/drafters/ddtree.md.
"""

from __future__ import annotations

from dspec_cli import hookimpl
from dspec_ddtree.drafter import DDTreeConfig, DDTreeDrafter
from dspec_ddtree.tree import grow_sampled_tree, grow_tree, sampled_shape

__all__ = ["DDTreeConfig", "DDTreeDrafter", "grow_sampled_tree", "grow_tree", "sampled_shape"]


@hookimpl
def dspec_register_drafters(register):
    register(DDTreeDrafter)
