"""The ``ddtree`` drafter: a best-first draft tree over a parallel drafter, verified in one pass.

It wraps a base drafter with the ``marginals`` capability (``dflash``, ``dspark-markov``,
``dspark-rnn``): one parallel forward of the base gives per-slot logits, the base's sequential
head (if any) conditions each node's children on the node's own token (and, for the RNN, on
its path), and :func:`~dspec_ddtree.tree.grow_tree` keeps the ``tree_budget`` best prefixes.
Scores use the base's own log-probs (T = 1, no top-k/top-p, as in DDTree): the engine's
sample-and-match walk commits only target samples, so the tree's shape never affects the
output distribution. With ``tree_mode="sampled"`` (T > 0) the tree is instead sampled from the
run's q in a static shape (:func:`~dspec_ddtree.tree.sampled_shape`,
:func:`~dspec_ddtree.tree.grow_sampled_tree`) and carries q, so the engine verifies it
by recursive rejection sampling. State, checkpoints and ``advance`` are the base's: a ddtree
checkpoint is the base drafter's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast

import torch

from dspec_cli import (
    Capability,
    Drafter,
    DrafterConfig,
    DraftState,
    DraftTree,
    DspecError,
    Proposal,
    Sampler,
    Target,
    WrappedDrafter,
    best_path,
    get_drafter_class,
    registry,
)
from dspec_ddtree.tree import grow_sampled_tree, grow_tree, sampled_shape

TREE_MODES = ("best", "sampled")


@dataclass
class DDTreeConfig(DrafterConfig):
    """DDTree options. ``block_size`` (the deepest node) is the base drafter's γ."""

    base: str = "dspark-markov"  # drafter whose per-position distributions grow the tree
    tree_budget: int = 32  # draft nodes per tree (the root/anchor not counted)
    tree_topk: int = 0  # children considered per node; 0 = tree_budget (capped by the vocabulary)
    # "best": the tree_budget best prefixes (DDTree; sample-and-match verification);
    # "sampled": children sampled without replacement from the run's q, verified with q by
    # recursive rejection sampling (at T = 0 the best-first tree is used).
    tree_mode: str = "sampled"
    # sampled trees have a static shape (sampled_shape) from two rates: the chance that a node's
    # first child is accepted, and that a later sibling is once the siblings before it were rejected
    tree_accept: float = 0.7
    tree_rescue: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree_mode not in TREE_MODES:
            raise DspecError(f"tree_mode must be one of {', '.join(TREE_MODES)}, got {self.tree_mode!r}")
        for key, low in (("tree_budget", 1), ("tree_topk", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DspecError(f"{key} must be an integer >= {low}, got {value!r}")
        for key in ("tree_accept", "tree_rescue"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise DspecError(f"{key} must be a number in (0, 1), got {value!r}")


class MarginalsDrafter(Protocol):
    """What a drafter with the ``marginals`` capability provides (dspec_dflash's block drafters)."""

    def block_marginals(self, state: DraftState, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel forward after anchors [R]: base logits U [R, γ, V] and slot features h [R, γ, d]."""
        ...

    def head_logits(self, logits: torch.Tensor, h: torch.Tensor, prev: torch.Tensor,
                    head_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slot logits U_k [..., V] after the sequential head given the previous tokens prev [...]."""
        ...


def base_class(name: str) -> type[Drafter]:
    """The installed drafter class ``name``, checked by :func:`check_base`."""
    try:
        cls = get_drafter_class(name)
    except DspecError:
        raise DspecError(f"base {name!r} is not an installed drafter; ddtree bases: {_bases()}") from None
    check_base(cls)
    return cls


def check_base(cls: type[Drafter]) -> None:
    """A one-line error naming the ``base`` option unless ``cls`` has per-position marginals."""
    if Capability.marginals not in cls.capabilities:
        raise DspecError(f"base {cls.name!r} has no per-position marginals (capability 'marginals'); ddtree bases: {_bases()}")


def _bases() -> str:
    reg = registry()
    return ", ".join(sorted(n for n, r in reg.drafters.items() if "marginals" in r.cls.capabilities))


def _checkpoint_drafter(path: str | Path) -> str | None:
    """The drafter name a checkpoint folder's config.json declares (None if unreadable)."""
    try:
        name = json.loads((Path(path) / "config.json").read_text()).get("drafter")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


class DDTreeDrafter(WrappedDrafter):
    """Best-first draft tree (DDTree) over a ``marginals`` drafter; see the module docstring."""

    name = "ddtree"
    config_class: ClassVar[type[DDTreeConfig]] = DDTreeConfig
    config: DDTreeConfig
    capabilities = frozenset({Capability.tree})
    description = "DDTree: best-first draft tree over a parallel drafter's per-position distributions (dflash, dspark)"

    def __init__(self, config: DDTreeConfig, target: Target, base: Drafter):
        check_base(type(base))
        max_ctx = target.max_context
        if max_ctx and config.tree_budget + 1 > max_ctx:
            raise DspecError(
                f"tree_budget {config.tree_budget} does not fit the target's context of {max_ctx} tokens "
                "(the anchor and every node are verified in one pass)"
            )
        if config.tree_topk > target.vocab_size:
            raise DspecError(f"tree_topk {config.tree_topk} exceeds the vocabulary ({target.vocab_size})")
        super().__init__(dataclasses.replace(config, base=base.name, block_size=base.config.block_size), target)
        self.base = base
        self._shape: tuple[tuple, torch.Tensor] | None = None  # (its options, sampled_shape(...))

    # -- construction: everything but the tree options comes from the base -----------------
    @classmethod
    def build(cls, config: DDTreeConfig, target: Target) -> DDTreeDrafter:
        """Over a fresh (untrained) base drafter of block size ``config.block_size``."""
        base = base_class(config.base)
        return cls(config, target, base.build(base.config_class(block_size=config.block_size), target))

    @classmethod
    def load_default(cls, target: Target, **overrides: Any) -> DDTreeDrafter:
        """Over the base's embedded default drafter."""
        config = cls.config_class.from_dict(overrides, where="ddtree")
        base = base_class(config.base).load_default(target, **_base_overrides(overrides))
        return cls(config, target, base)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Target, **overrides: Any) -> DDTreeDrafter:
        """Over the base checkpoint at ``path``; the base defaults to the drafter it declares."""
        saved = _checkpoint_drafter(path)
        values = {"base": saved, **overrides} if saved else dict(overrides)
        config = cls.config_class.from_dict(values, where="ddtree")
        base = base_class(config.base).from_pretrained(path, target, **_base_overrides(overrides))
        return cls(config, target, base)

    def save_pretrained(self, path: str | Path) -> None:
        self.base.save_pretrained(path)

    # -- the decoding cycle: the base's state (WrappedDrafter) ------------------------------
    @torch.no_grad()
    def propose(self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        """A tree of up to ``tree_budget`` nodes and depth min(max_len, γ); the chain fields hold
        its best path (draft_probs None). Best-first trees do not use ``sampler`` (the walk samples
        the target); sampled trees (T > 0) draw with its distribution, without replacement."""
        if self.config.tree_mode == "sampled" and sampler is not None and not sampler.greedy:
            tree, scores = self.draft_sampled_tree(state, anchors, max_len, sampler)
        else:
            tree, scores = self.draft_tree(state, anchors, max_len)
        path, lengths = best_path(tree.tokens, tree.parents, scores, min(max_len, self.config.block_size))
        return Proposal(tokens=path, lengths=lengths, tree=tree)

    @torch.no_grad()
    def draft_tree(self, state: DraftState, anchors: torch.Tensor, max_len: int) -> tuple[DraftTree, torch.Tensor]:
        """The tree after ``anchors`` [R] and its node scores [R, N] (cumulative log-probs)."""
        expand, depth, topk = self._expansion(state, anchors, max_len)
        tokens, parents, scores = grow_tree(expand, anchors, depth, self.config.tree_budget, topk)
        R, N = tokens.shape
        num_nodes = torch.full((R,), N, dtype=torch.long, device=anchors.device)
        return DraftTree(tokens=tokens, parents=parents, num_nodes=num_nodes), scores

    @torch.no_grad()
    def draft_sampled_tree(
        self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler
    ) -> tuple[DraftTree, torch.Tensor]:
        """A sampled tree after ``anchors`` [R] (:func:`~dspec_ddtree.tree.grow_sampled_tree`,
        q = ``sampler.probs``) with its draft probabilities, and its node scores [R, N]."""
        expand, depth, topk = self._expansion(state, anchors, max_len)
        cfg = self.config
        key = (cfg.tree_budget, cfg.block_size, topk, cfg.tree_accept, cfg.tree_rescue)
        if self._shape is None or self._shape[0] != key:
            self._shape = key, sampled_shape(*key)
        tokens, parents, scores, num_nodes, q = grow_sampled_tree(
            expand, sampler.probs, lambda slot, q, n: sampler.sample_distinct(q, n, slot), anchors, depth, self._shape[1]
        )
        return DraftTree(tokens=tokens, parents=parents, num_nodes=num_nodes, draft_probs=q), scores

    def _expansion(self, state: DraftState, anchors: torch.Tensor, max_len: int):
        """One parallel forward of the base: the tree builders' ``expand`` (children logits of
        frontier nodes at a slot), the tree depth and the children considered per node."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        cfg, base = self.config, cast(MarginalsDrafter, self.base)  # check_base: capability "marginals"
        logits, h = base.block_marginals(state, anchors)  # [R, γ, V], [R, γ, d]

        def expand(slot: int, tokens: torch.Tensor, head_state: torch.Tensor | None):
            return base.head_logits(logits[:, slot, None], h[:, slot, None], tokens, head_state)

        return expand, min(max_len, cfg.block_size), min(cfg.tree_topk or cfg.tree_budget, logits.shape[-1])


def _base_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Of ddtree's overrides, those the base takes (its block size)."""
    return {k: v for k, v in overrides.items() if k == "block_size"}
