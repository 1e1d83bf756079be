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
by recursive rejection sampling or traversal verification. With ``tree_shape="confidence"`` each
request's sampled tree is cut, every round, to the nodes DSpark's Algorithm 1 admits under the
cost table (``cost_table``): node survival from the base's calibrated confidences (its
confidence head on the node's token, else Σq²), so a tree is wide where the drafter is unsure and
a chain where it is sure. State, checkpoints and ``advance`` are the base's: a ddtree checkpoint
is the base drafter's checkpoint.
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
    CostTable,
    Drafter,
    DrafterConfig,
    DraftState,
    DraftTree,
    DspecError,
    Proposal,
    Sampler,
    Target,
    WrappedDrafter,
    admit_candidates,
    best_path,
    get_drafter_class,
    registry,
)
from dspec_ddtree.tree import (
    grow_sampled_tree,
    grow_tree,
    node_depths,
    node_survival,
    prune_tree,
    sampled_shape,
)

TREE_MODES = ("best", "sampled")
TREE_SHAPES = ("static", "confidence")


@dataclass
class DDTreeConfig(DrafterConfig):
    """DDTree options. ``block_size`` (the deepest node) is the base drafter's γ."""

    base: str = "dspark-markov"  # drafter whose per-position distributions grow the tree
    tree_budget: int = 32  # draft nodes per tree (the root/anchor not counted)
    tree_topk: int = 0  # children considered per node; 0 = tree_budget (capped by the vocabulary)
    # "best": the tree_budget best prefixes (DDTree; sample-and-match verification);
    # "sampled": children sampled without replacement from the run's q, verified with q (the run's
    # tree_verify rule: traversal verification or recursive rejection; at T = 0 the best-first tree).
    tree_mode: str = "sampled"
    # sampled trees have a static shape (sampled_shape) from two rates: the chance that a node's
    # first child is accepted, and that a later sibling is once the siblings before it were rejected
    tree_accept: float = 0.7
    tree_rescue: float = 0.3
    # sampled trees: "static" verifies the whole shape; "confidence" cuts each request's tree to the
    # nodes DSpark's Algorithm 1 admits under the cost table, from calibrated node confidences
    tree_shape: str = "static"
    cost_table: str = ""  # `dspec profile-hardware` table (or SGLang's) for tree_shape=confidence

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree_mode not in TREE_MODES:
            raise DspecError(f"tree_mode must be one of {', '.join(TREE_MODES)}, got {self.tree_mode!r}")
        if self.tree_shape not in TREE_SHAPES:
            raise DspecError(f"tree_shape must be one of {', '.join(TREE_SHAPES)}, got {self.tree_shape!r}")
        if (self.tree_shape == "confidence") != bool(self.cost_table):
            raise DspecError("tree_shape=confidence needs cost_table=PATH (from `dspec profile-hardware --json`), "
                             "and cost_table is only used by it")
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
        self.cost_table = (
            CostTable.load(config.cost_table, block_size=config.block_size, what="ddtree cost_table")
            if config.cost_table else None
        )
        if self.cost_table is not None:
            self.cost_table.check(device=target.device)

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
    def verify_tokens(self, max_len: int) -> int:
        """The anchor and up to ``tree_budget`` nodes."""
        return self.config.tree_budget + 1

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
        expand, depth, topk, _ = self._expansion(state, anchors, max_len)
        tokens, parents, scores = grow_tree(expand, anchors, depth, self.config.tree_budget, topk)
        R, N = tokens.shape
        num_nodes = torch.full((R,), N, dtype=torch.long, device=anchors.device)
        return DraftTree(tokens=tokens, parents=parents, num_nodes=num_nodes), scores

    @torch.no_grad()
    def draft_sampled_tree(
        self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler
    ) -> tuple[DraftTree, torch.Tensor]:
        """A sampled tree after ``anchors`` [R] (:func:`~dspec_ddtree.tree.grow_sampled_tree`,
        q = ``sampler.probs``) with its draft probabilities, and its node scores [R, N]; with
        ``tree_shape="confidence"`` cut to the nodes :meth:`admitted_nodes` keeps."""
        expand, depth, topk, h = self._expansion(state, anchors, max_len)
        cfg = self.config
        key = (cfg.tree_budget, cfg.block_size, topk, cfg.tree_accept, cfg.tree_rescue)
        if self._shape is None or self._shape[0] != key:
            self._shape = key, sampled_shape(*key).to(anchors.device)  # on the device once
        tokens, parents, scores, num_nodes, q = grow_sampled_tree(
            expand, sampler.probs, lambda slot, q, n: sampler.sample_distinct(q, n, slot), anchors, depth, self._shape[1]
        )
        if cfg.tree_shape == "confidence":
            keep = self.admitted_nodes(h, anchors, tokens, parents, num_nodes, q, depth)
            tokens, parents, scores, num_nodes, q = prune_tree(tokens, parents, scores, q, keep)
        return DraftTree(tokens=tokens, parents=parents, num_nodes=num_nodes, draft_probs=q,
                         fanout=self._shape[1].shape[1]), scores  # pruning never adds children

    def admitted_nodes(
        self,
        h: torch.Tensor,  # [R, γ, d] the base's slot features
        anchors: torch.Tensor,  # [R] long
        tokens: torch.Tensor,  # [R, N] long, -1 padded
        parents: torch.Tensor,  # [R, N] long, local, -1 padded
        num_nodes: torch.Tensor,  # [R] long
        q: torch.Tensor,  # [R, N+1, V] each node's children distribution
        depth: int,
    ) -> torch.Tensor:
        """The nodes [R, N] bool that DSpark's Algorithm 1 admits over the whole batch: survival
        values from :func:`~dspec_ddtree.tree.node_survival` with c_v = the calibrated chance that
        v's first child is accepted (the base's confidence head at the children's slot given v's
        token, else Σq_v²), in descending order until Θ = τ·SPS(B) stops rising. Every value
        depends on the tokens above a node only, never on its own or its descendants', and the
        values never rise from a parent to a child or from a sibling to a later one, so the kept
        nodes are a valid tree of the drafted one (see docs/drafters/ddtree.md)."""
        R, N = tokens.shape
        node_depth = node_depths(parents, depth)  # [R, N+1]
        slot = node_depth.clamp(max=h.shape[1] - 1)  # the slot of a node's children (leaves: unused)
        node_tokens = torch.cat([anchors[:, None], tokens.clamp(min=0)], 1)  # [R, N+1]
        h_nodes = h.gather(1, slot[..., None].expand(-1, -1, h.shape[-1]))  # [R, N+1, d]
        conf = getattr(self.base, "head_confidence", lambda *_: None)(h_nodes, node_tokens)
        if conf is None:  # no confidence head: the Σq² heuristic of the children's distribution
            conf = q.float().pow(2).sum(-1)
        conf = conf.clamp(1e-4, 1 - 1e-4)
        if self.calibration is not None:  # STS at the children's position
            conf = self.calibration.apply(conf[..., None].expand(-1, -1, h.shape[1]).contiguous())
            conf = conf.gather(-1, slot[..., None]).squeeze(-1)
        survival = node_survival(parents, conf, self.config.tree_rescue, depth)
        valid = torch.arange(N, device=tokens.device) < num_nodes[:, None]
        if self.cost_table is None:  # unreachable: DDTreeConfig requires cost_table with tree_shape=confidence
            raise DspecError("tree_shape=confidence needs cost_table=PATH")
        sps = self.cost_table.sps_curve(R * (N + 1), None, tokens.device)
        return admit_candidates(survival, valid, sps)

    def _expansion(self, state: DraftState, anchors: torch.Tensor, max_len: int):
        """One parallel forward of the base: the tree builders' ``expand`` (children logits of
        frontier nodes at a slot), the tree depth, the children considered per node and the slot
        features h [R, γ, d]."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        cfg, base = self.config, cast(MarginalsDrafter, self.base)  # check_base: capability "marginals"
        logits, h = base.block_marginals(state, anchors)  # [R, γ, V], [R, γ, d]

        def expand(slot: int, tokens: torch.Tensor, head_state: torch.Tensor | None):
            return base.head_logits(logits[:, slot, None], h[:, slot, None], tokens, head_state)

        return expand, min(max_len, cfg.block_size), min(cfg.tree_topk or cfg.tree_budget, logits.shape[-1]), h


def _base_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Of ddtree's overrides, those the base takes (its block size)."""
    return {k: v for k, v in overrides.items() if k == "block_size"}
