"""The parallel block drafter shared by ``dflash``, ``dspark-markov`` and ``dspark-rnn``.

One implementation of everything but the draw: the :mod:`dspec_cli.nn.backbone` backbone plus an
optional sequential head (Markov / RNN, :mod:`dspec_cli.nn.heads`; DSpark's) and an optional
confidence head. :meth:`DFlashDrafter.propose` draws DFlash's independent slots; DSpark's
left-to-right proposer is ``dspec_dspark.drafter``.

Block layout (DeepSpec's variant, ``deepspec/modeling/dspark/common.py``): the block is [anchor, mask × (γ−1)] and
the anchor slot is itself the first prediction position, so γ input slots give γ drafts
(slot k predicts the token after position a+k). The original DFlash paper (and z-lab's
checkpoints) feeds anchor + γ masks and predicts only the masks; DeepSpec's DFlash baseline and
DSpark use the variant here. ``anchor_predicts = False`` selects the original layout, for
training and inference (z-lab checkpoints, :mod:`dspec_cli.checkpoints.layouts`).

The target's input embedding and LM head are shared and frozen: taken from the target at
build time, never stored in our checkpoints. The mask token id defaults to the tokenizer's
``<|mask|>`` (or ``<|MASK|>``, ``<mask>``) when it has one, else the first embedding row past
the tokenizer's vocabulary (DFlash/DeepSpec's choice for Qwen3: 151669), else the pad token,
else the last id. The resolved id is stored in config.json.

Decoding state: a :class:`~dspec_cli.nn.backbone.ContextCache` with the context K/V of every
committed token (prompt, anchors, accepted drafts). The anchor itself is not in the cache (its
target hidden state is unknown until verified), matching the training rule "context strictly
before the anchor". One backbone forward per round serves all rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dspec_cli import (
    Capability,
    DrafterConfig,
    DraftState,
    DspecError,
    Proposal,
    Sampler,
    Target,
    TrainableDrafter,
)
from dspec_cli.nn import (
    BackboneConfig,
    ConfidenceHead,
    ContextCache,
    PackedWeight,
    ParallelBackbone,
    build_blocks,
    build_head,
    build_target_layer_ids,
    resolve_backbone_config,
    sample_anchors,
    training_mask,
)
from dspec_dflash.loss import block_losses

_MASK_TOKENS = ("<|mask|>", "<|MASK|>", "<mask>")


@dataclass
class BlockDrafterConfig(BackboneConfig, DrafterConfig):
    """Hyper-parameters of a parallel block drafter (defaults: DeepSpec's DFlash, B = γ = 7).

    Architecture fields left at 0 / "" / None are copied from the target when built (as
    DeepSpec copies the target config) and then stored resolved. ``target_layer_ids`` ()
    defaults to :func:`~dspec_cli.nn.backbone.build_target_layer_ids`; ``mask_token_id`` -1 to the
    rule in the module docstring. Losses: ``ce_weight``·CE + ``l1_weight``·‖p_d − p_t‖₁ +
    ``conf_weight``·BCE, position weights exp(−k/``loss_decay_gamma``) for slots k = 0..γ−1
    (DeepSpec's code; the paper writes exp(−(k−1)/γ) with k from 1).
    """

    mask_token_id: int = -1
    vocab_size: int = 0  # 0 = the target's; a stored value must match the target
    head: str = "none"  # sequential head: none | markov | rnn
    markov_rank: int = 0  # r of W1 [V, r] / W2 [r, V]
    confidence_head: bool = False
    ce_weight: float = 1.0
    l1_weight: float = 0.0
    conf_weight: float = 0.0
    loss_decay_gamma: float = 4.0
    num_anchors: int = 512  # blocks sampled per training sequence
    attention: str = "auto"  # training attention: auto (flex on CUDA) | dense | flex
    anchor_predicts: bool = True  # False: [anchor, mask × γ], masks predict (original DFlash)

    LAYER_STYLES: ClassVar[tuple[str, ...]] = ("qwen3", "gemma4")  # ParallelBackbone implements both

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (self.num_layers >= 1, f"num_layers must be >= 1, got {self.num_layers}"),
            (self.head in ("none", "markov", "rnn"), f"head must be none, markov or rnn, got {self.head!r}"),
            (self.markov_rank >= 0, f"markov_rank must be >= 0, got {self.markov_rank}"),
            (self.head == "none" or self.markov_rank > 0, f"head {self.head!r} needs markov_rank > 0"),
            (self.num_anchors >= 1, f"num_anchors must be >= 1, got {self.num_anchors}"),
            (self.loss_decay_gamma > 0, f"loss_decay_gamma must be > 0, got {self.loss_decay_gamma}"),
            (min(self.ce_weight, self.l1_weight, self.conf_weight) >= 0, "loss weights must be >= 0"),
            (self.attention in ("auto", "dense", "flex"), f"attention must be auto, dense or flex, got {self.attention!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DspecError(message)


@dataclass
class DFlashConfig(BlockDrafterConfig):
    """DFlash (DeepSpec defaults): no sequential head, CE only; a confidence head is optional
    (DeepSpec's DSpark layout with ``markov_rank`` 0 carries one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head != "none":
            raise DspecError(f"dflash has no sequential head (head = 'none', got {self.head!r}); "
                             "dspark-markov and dspark-rnn have one")


@dataclass(kw_only=True)
class BlockDraftState(DraftState):
    """Context K/V of committed tokens for every row (``context`` token lists are not kept)."""

    cache: ContextCache

    @property
    def num_requests(self) -> int:
        return self.cache.rows


@dataclass
class BlockOutputs:
    """Per supervised slot (M of them) of a training forward."""

    logits: torch.Tensor  # [M, V] float draft logits (head-corrected)
    target_logits: torch.Tensor  # [M, V] float target logits at the same positions (no grad)
    labels: torch.Tensor  # [M] the token each slot predicts
    where: torch.Tensor  # [M, 3] (sequence, block, slot k)
    conf_logits: torch.Tensor | None  # [M] confidence-head logits


class BlockDrafterNet(nn.Module):
    """The trainable weights: backbone, optional sequential head, optional confidence head."""

    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        self.backbone = ParallelBackbone(cfg, len(cfg.target_layer_ids))
        self.head = build_head(cfg.head, cfg.vocab_size, cfg.markov_rank, cfg.hidden_size)
        rank = cfg.markov_rank if self.head is not None else 0
        self.confidence = ConfidenceHead(cfg.hidden_size, rank) if cfg.confidence_head else None
        self.apply(lambda m: _init_weights(m, cfg.initializer_range))


def _init_weights(module: nn.Module, std: float) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def default_mask_token_id(target: Target) -> int:
    """See the module docstring."""
    tok = target.tokenizer
    if tok is not None:
        vocab = tok.get_vocab()
        for name in _MASK_TOKENS:
            if name in vocab:
                return int(vocab[name])
        if len(tok) < target.vocab_size:
            return len(tok)
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
    return target.vocab_size - 1


def resolve_config(cfg: BlockDrafterConfig, target: Target) -> BlockDrafterConfig:
    """Fill target-derived fields; a stored size that differs from the target is a DspecError."""
    values: dict[str, Any] = resolve_backbone_config(cfg, target.config)
    vocab = target.vocab_size
    if cfg.vocab_size and cfg.vocab_size != vocab:
        raise DspecError(f"drafter vocabulary size {cfg.vocab_size} does not match the target's {vocab}")
    ids = tuple(cfg.target_layer_ids) or build_target_layer_ids(target.num_layers, cfg.num_layers)
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)) or not -1 <= min(ids) <= max(ids) < target.num_layers:
        raise DspecError(
            f"target_layer_ids {list(ids)} must increase strictly within [-1, {target.num_layers - 1}] for this target"
        )
    mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token_id(target)
    if mask >= vocab:
        raise DspecError(f"mask_token_id {mask} is outside the target vocabulary (size {vocab})")
    values.update(vocab_size=vocab, target_layer_ids=ids, mask_token_id=mask)
    return dataclasses.replace(cfg, **values)


class DFlashDrafter(TrainableDrafter):
    """Parallel block drafter with KV injection; base class of the DSpark drafters."""

    name = "dflash"
    config_class = DFlashConfig
    config: BlockDrafterConfig
    net: BlockDrafterNet
    capabilities = frozenset({Capability.draft_probs, Capability.marginals, Capability.trainable})
    description = "parallel block drafter with target KV injection (DFlash, DeepSpec variant)"

    def __init__(self, config: BlockDrafterConfig, target: Target):
        super().__init__(resolve_config(config, target), target)
        self.embed = target.model.get_input_embeddings()  # shared, frozen, not in self.net
        self.lm_head = target.model.get_output_embeddings()
        self._lm_pack = PackedWeight()  # the LM head's packed copy for CPU decoding (dspec_cli.nn.linear)
        self.softcap = getattr(target.config, "final_logit_softcapping", None)
        self.net = BlockDrafterNet(self.config).to(device=target.device, dtype=target.dtype)

    # -- decoding --------------------------------------------------------------------------
    def init_state(self) -> BlockDraftState:
        return BlockDraftState(cache=self.net.backbone.new_cache())

    @torch.no_grad()
    def add_requests(self, state: BlockDraftState, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        if hidden is None or len(hidden) != len(prompts):
            raise ValueError(f"hidden: {self.name} needs the target's taps for every prompt")
        self._check_taps(hidden[0])
        cache, dev = state.cache, self.target.device
        old = cache.rows
        counts = torch.tensor([0] * old + [h.shape[0] for h in hidden], dtype=torch.long, device=dev)
        cache.add_rows(len(hidden))
        self.net.backbone.extend_cache(cache, torch.cat(hidden), counts, max(h.shape[0] for h in hidden))

    def remove_requests(self, state: BlockDraftState, keep: list[int]) -> None:
        state.cache.keep_rows(keep)

    @torch.no_grad()
    def advance(self, state: BlockDraftState, committed, counts, hidden) -> None:
        """Append the taps of committed tokens (per row: anchor + accepted drafts of one or more rounds)."""
        if hidden is None:
            raise ValueError(f"hidden: {self.name} needs the target's taps of committed tokens")
        self._check_taps(hidden)
        counts = counts.to(self.target.device)
        self.net.backbone.extend_cache(state.cache, hidden, counts, int(counts.max()) if counts.numel() else 0)

    @torch.no_grad()
    def advance_grid(self, state: BlockDraftState, committed, counts, hidden) -> None:
        """Padded rows (capturable): hidden [n, W, n·d] of which the first counts [n] per row."""
        if hidden is None:
            raise ValueError(f"hidden: {self.name} needs the target's taps of committed tokens")
        self._check_taps(hidden)
        self.net.backbone.extend_cache_grid(state.cache, hidden, counts)

    def reserve(self, state: BlockDraftState, rows: int, slots: int) -> bool:
        return state.cache.reserve(rows, slots)

    def capture_key(self, state: BlockDraftState, bucket: int):
        """The context window (fixed for this round, rounded up to ``bucket``) and the cache's
        storage generation."""
        return state.cache.fix_window(bucket), state.cache.generation

    def settle(self, state: BlockDraftState, lengths: list[int]) -> None:
        state.cache.settle(max(lengths, default=0))

    @torch.no_grad()
    def block_logits(self, state: BlockDraftState, anchors: torch.Tensor) -> torch.Tensor:
        """Per-slot base logits U [R, γ, V] (float) of one parallel forward: DFlash's marginals."""
        return self.block_marginals(state, anchors)[0]

    @torch.no_grad()
    def block_marginals(self, state: BlockDraftState, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel forward for tree builders (capability ``marginals``): base logits
        U [R, γ, V] (float) and slot features h [R, γ, d]; :meth:`head_logits` conditions slot k
        on the previous token."""
        h = self.block_hidden(state, anchors)
        return self.lm_logits(h), h

    def head_logits(self, logits: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, head_state):
        """Slot logits after the sequential head: U_k [..., V] (float) and h_k [..., d], both
        broadcast against the previous tokens prev [...] (slot 0: the anchor), with the head
        state None at slot 0, else the tensor [..., s] this returned for the slot before
        (aligned with prev). Returns (logits [..., V] float, next state); no head: (U_k, None)."""
        head = self.net.head
        if head is None:
            return logits, None
        h = h.expand(*prev.shape, h.shape[-1])
        if head_state is None:
            head_state = head.init_state(prev.numel(), h)
            if head_state is not None:
                head_state = head_state.view(*prev.shape, -1)
        bias, head_state = head.step_bias(head_state, prev, h)
        return logits + bias, head_state  # float logits + a half-precision bias: float (exact promotion)

    def head_confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Raw confidence [...] (float, uncalibrated) that a draft in the slot of features h [..., d]
        is accepted once its prefix is, from the confidence head and the previous token prev [...]
        (for tree builders: prev is the parent node's token); None without a confidence head."""
        conf_head, head = self.net.confidence, self.net.head
        if conf_head is None:
            return None
        return torch.sigmoid(conf_head(h, head.embed(prev) if head is not None else None).float())

    @torch.no_grad()
    def propose(self, state: BlockDraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        """DFlash's proposal after ``anchors`` [R]: one parallel forward, then every slot drawn at
        once and independently, x_k from q_k = sampler.probs(U_k). Greedy runs draft the argmax
        and carry no distribution (deterministic drafts). The DSpark drafters (``dspec_dspark``)
        draw left to right through their sequential head instead."""
        h = self.block_hidden(state, anchors)[:, : min(max_len, self.config.block_size)]  # [R, γ, d]
        base = self.lm_logits(h)  # [R, γ, V]: one LM-head matmul for the whole block
        if sampler.greedy:
            return self.block_proposal(h, anchors, base.argmax(-1), None)
        probs = sampler.probs(base.flatten(0, 1)).view_as(base)  # [R, γ, V]
        return self.block_proposal(h, anchors, sampler.sample(probs, 0), probs)

    def block_proposal(self, h: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor,
                       probs: torch.Tensor | None) -> Proposal:
        """The proposal of drafts [R, γ] drawn from probs [R, γ, V] (None: deterministic) after
        anchors [R], with the confidence head's raw c_k (if any) from slot features h [R, γ, d]
        and x_{k−1} only, in one pass over the block."""
        conf = self.head_confidence(h, torch.cat([anchors[:, None], drafts[:, :-1]], 1))  # raw, x_{k−1} [R, γ]
        lengths = torch.full((anchors.shape[0],), drafts.shape[1], dtype=torch.long, device=anchors.device)
        return Proposal(tokens=drafts, lengths=lengths, draft_probs=probs, confidence=conf)

    def block_hidden(self, state: BlockDraftState, anchors: torch.Tensor) -> torch.Tensor:
        """h [R, γ, d] for blocks [anchor, mask × (γ−1)] after each row's committed context."""
        cache = state.cache
        rows = anchors.shape[0]
        if anchors.dim() != 1 or not cache.rows <= rows <= cache.lengths_rows(rows).shape[0]:
            raise ValueError(f"anchors must be [R={cache.rows}] (or padded past R), got {tuple(anchors.shape)}")
        skip = 0 if self.config.anchor_predicts else 1  # original DFlash: the anchor slot predicts nothing
        slots = self.config.block_size + skip
        ids = torch.full((rows, slots), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        pos = cache.lengths_rows(rows)[:, None] + torch.arange(slots, device=anchors.device)
        return self.net.backbone.forward_block(self.embed(ids), pos, cache)[:, skip:]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head (with its final-logit softcap, if any) -> float logits.
        Gradients reach h, never the target's weights."""
        w, b = self.lm_head.weight.detach(), self.lm_head.bias
        # one [N, d] x [d, V] matmul: a strided 3-D input would make linear broadcast the
        # weight to [R, d, V] and copy it (bf16 CPU: 40 ms at R = 16)
        z = self._lm_pack.linear(h.to(w.dtype).reshape(-1, h.shape[-1]), w, None if b is None else b.detach())
        z = z.view(*h.shape[:-1], -1).float()
        return z if not self.softcap else self.softcap * torch.tanh(z / self.softcap)

    def _check_taps(self, taps: torch.Tensor) -> None:
        want = len(self.config.target_layer_ids) * self.config.hidden_size
        if taps.shape[-1] != want:
            raise ValueError(f"hidden: expected taps of width {want} (target_layer_ids x hidden), got {taps.shape[-1]}")

    # -- training --------------------------------------------------------------------------
    def training_loss(
        self, batch: dict[str, torch.Tensor], target_features: dict[str, torch.Tensor],
        generator: torch.Generator | None = None,
    ) -> dict:
        """Loss over up to ``num_anchors`` random blocks per sequence (see
        :func:`~dspec_dflash.loss.block_losses` for the terms and metrics).

        batch {"input_ids", "loss_mask"} [b, L] (right-padded); target_features {"taps"
        [b, L, n·d], "last_hidden" [b, L, d]}. ``generator`` seeds the anchor choice.
        """
        cfg = self.config
        anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, generator)
        out = self.block_outputs(batch, target_features, anchors, keep)
        return block_losses(
            out.logits, out.target_logits, out.labels, out.where[:, 2], out.conf_logits,
            block_size=cfg.block_size, ce_weight=cfg.ce_weight, l1_weight=cfg.l1_weight,
            conf_weight=cfg.conf_weight, decay_gamma=cfg.loss_decay_gamma,
        )

    def block_outputs(
        self, batch: dict[str, torch.Tensor], target_features: dict[str, torch.Tensor],
        anchors: torch.Tensor, keep: torch.Tensor,
    ) -> BlockOutputs:
        """Draft / target logits of the supervised slots of the blocks at ``anchors`` [b, N]
        (``keep`` [b, N]), heads teacher-forced with the true previous tokens.

        Draft slot k (0-based) predicts x_{a+k+1} in both layouts; with ``anchor_predicts =
        False`` the block has one more input slot, [anchor, mask × γ], and slot k is read from
        input slot k + 1 (the anchor slot predicts nothing)."""
        cfg, B = self.config, self.config.block_size
        skip = 0 if cfg.anchor_predicts else 1
        S = B + skip  # input slots per block
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        taps, last = target_features["taps"], target_features["last_hidden"]
        if ids.dim() != 2 or loss_mask.shape != ids.shape or taps.shape[:2] != ids.shape or last.shape[:2] != ids.shape:
            raise ValueError("batch input_ids/loss_mask [b, L] and target taps/last_hidden [b, L, ·] must agree")
        self._check_taps(taps)
        b, L = ids.shape
        n = anchors.shape[1]
        blocks = build_blocks(ids, loss_mask, anchors, keep, S, cfg.mask_token_id)
        mask = training_mask(anchors, keep, L, S, cfg.attention)
        with torch.no_grad():
            embeds = self.embed(blocks.input_ids.view(b, n * S))
        h = self.net.backbone.forward_train(embeds, blocks.positions.view(b, n * S), taps, mask).view(b, n, S, -1)
        h = h[:, :, skip:]  # [b, N, B, d]: the draft slots
        # draft slot k: label x_{a+k+1}, previous token x_{a+k}, target distribution at position a+k
        labels, prev, sel, pos = (t[..., :B] for t in (blocks.labels, blocks.prev, blocks.valid, blocks.positions))
        logits = self.lm_logits(h[sel])  # [M, V]
        head, conf_head = self.net.head, self.net.confidence
        if head is not None:
            logits = logits + head.bias(head.block_features(prev, h)[sel]).float()
        conf_logits = None
        if conf_head is not None:
            prev_embed = head.embed(prev[sel]) if head is not None else None
            conf_logits = conf_head(h[sel], prev_embed).float()
        where = sel.nonzero()  # [M, 3] (sequence, block, slot)
        with torch.no_grad():
            target_logits = self.lm_logits(last[where[:, 0], pos[sel]])  # p_t at position a+k
        return BlockOutputs(logits, target_logits, labels[sel], where, conf_logits)

