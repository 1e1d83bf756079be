"""The ``eagle3`` drafter: configuration, checkpoints, decoding state, propose / advance.

Decoding state per row (committed length n, anchor x_n not yet committed):

* ``cache``: a :class:`~dspec_cli.nn.backbone.ContextCache` (one layer) with the K/V of the pairs
  (g_t = fc(taps_t), x_{t+1}) at positions t = 0..n−2: every committed token whose successor
  is committed too. Its length is therefore n − 1.
* ``pending`` [R, n·d]: the taps of x_{n−1}, whose successor is the anchor.

``propose`` runs step 0 on (fc(pending), anchor) at position n−1, then feeds its own outputs
(chain) or expands an EAGLE-2 tree (:mod:`dspec_cli.runtime.tree_select`); draft K/V live only in local
tensors, so nothing has to be rolled back. ``advance`` appends the c committed tokens (anchor
+ accepted drafts, for trees the accepted path) paired with [pending, taps[:-1]] and keeps
taps[-1] as the new pending features.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspec_cli import (
    Capability,
    DrafterConfig,
    DraftState,
    DraftTree,
    DspecError,
    Proposal,
    Sampler,
    Target,
    TrainableDrafter,
    best_path,
    select_tree,
)
from dspec_cli.nn import BackboneConfig, ContextCache, resolve_backbone_config
from dspec_eagle3.loss import ttt_losses, ttt_outputs
from dspec_eagle3.model import Eagle3Net, build_vocab_mapping


@dataclass
class Eagle3Config(BackboneConfig, DrafterConfig):
    """EAGLE-3 hyper-parameters. Architecture fields left at 0 / "" / None are copied from the
    target and stored resolved; ``target_layer_ids`` () = :func:`default_layer_ids`."""

    num_layers: int = 1  # EAGLE-3 drafts with a single decoder layer
    vocab_size: int = 0  # the target's vocabulary (stored to reject a mismatched target)
    draft_vocab_size: int = 0  # N: LM-head size; 0 = the full target vocabulary
    ttt_length: int = 7  # training-time-test steps
    loss_decay: float = 0.8  # step j is weighted loss_decay^j
    attention: str = "auto"  # training attention: auto (flex on CUDA) | dense | flex
    tree: bool = False  # propose an EAGLE-2 dynamic tree instead of a chain
    tree_top_k: int = 10  # children expanded per node and frontier width per depth
    tree_depth: int = 7  # deepest draft node (also capped by the round's max_len)
    tree_total_tokens: int = 60  # verified tokens per request, root included (N_r <= this − 1)
    qk_norm: bool = True  # per-head q/k RMSNorm (Qwen3 style); False = Llama style (SpecForge)

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            (self.num_layers == 1, f"num_layers must be 1 (EAGLE-3 has one decoder layer), got {self.num_layers}"),
            (self.draft_vocab_size >= 0, f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}"),
            (self.ttt_length >= 1, f"ttt_length must be >= 1, got {self.ttt_length}"),
            (0 < self.loss_decay <= 1, f"loss_decay must be in (0, 1], got {self.loss_decay}"),
            (self.attention in ("auto", "dense", "flex"), f"attention must be auto, dense or flex, got {self.attention!r}"),
            (self.tree_top_k >= 1, f"tree_top_k must be >= 1, got {self.tree_top_k}"),
            (self.tree_depth >= 1, f"tree_depth must be >= 1, got {self.tree_depth}"),
            (self.tree_total_tokens >= 2, f"tree_total_tokens must be >= 2, got {self.tree_total_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DspecError(message)


@dataclass(kw_only=True)
class Eagle3State(DraftState):
    """Draft K/V of committed pairs and the pending features per row (module docstring)."""

    cache: ContextCache
    pending: torch.Tensor  # [R, n·d]

    @property
    def num_requests(self) -> int:
        return self.cache.num_rows


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3 / SpecForge taps (1, L//2 − 1, L − 4) (low, mid, high); targets with fewer than
    7 layers, where those collide, get three evenly spaced layers of 0..L−1 (fewer if L < 3)."""
    L = num_layers
    if L >= 7:
        return (1, L // 2 - 1, L - 4)
    return tuple(sorted({round(i * (L - 1) / 2) for i in range(3)}))


def resolve_config(cfg: Eagle3Config, target: Target) -> Eagle3Config:
    """Fill target-derived fields; sizes that do not fit the target are a DspecError."""
    values: dict[str, Any] = resolve_backbone_config(cfg, target.config)
    vocab, layers = target.vocab_size, target.num_layers
    if cfg.vocab_size and cfg.vocab_size != vocab:
        raise DspecError(f"drafter vocabulary size {cfg.vocab_size} does not match the target's {vocab}")
    if cfg.draft_vocab_size > vocab:
        raise DspecError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target vocabulary ({vocab})")
    ids = tuple(cfg.target_layer_ids) or default_layer_ids(layers)
    if len(set(ids)) != len(ids) or not -1 <= min(ids) <= max(ids) < layers:
        raise DspecError(f"target_layer_ids {list(ids)} must be distinct layers in [-1, {layers - 1}] for this target")
    draft_vocab = 0 if cfg.draft_vocab_size == vocab else cfg.draft_vocab_size
    if cfg.tree and cfg.tree_top_k > (draft_vocab or vocab):
        raise DspecError(f"tree_top_k {cfg.tree_top_k} exceeds the draft vocabulary ({draft_vocab or vocab})")
    values.update(vocab_size=vocab, target_layer_ids=ids, draft_vocab_size=draft_vocab)
    return dataclasses.replace(cfg, **values)


class Eagle3Drafter(TrainableDrafter):
    """EAGLE-3: autoregressive single-layer drafter over fused low/mid/high target features."""

    name = "eagle3"
    config_class = Eagle3Config
    config: Eagle3Config
    net: Eagle3Net
    capabilities = frozenset({Capability.draft_probs, Capability.tree, Capability.trainable})
    description = "EAGLE-3: one decoder layer over fused low/mid/high target features (chain or EAGLE-2 tree)"

    def __init__(self, config: Eagle3Config, target: Target):
        super().__init__(resolve_config(config, target), target)
        cfg = self.config
        self.embed = target.model.get_input_embeddings()  # shared, frozen, not in self.net
        self.target_head = target.model.get_output_embeddings()  # training targets only
        self.softcap = getattr(target.config, "final_logit_softcapping", None)
        reduced = cfg.draft_vocab_size > 0
        draft_vocab = cfg.draft_vocab_size or cfg.vocab_size
        self.net = Eagle3Net(cfg, len(cfg.target_layer_ids), draft_vocab, reduced, cfg.qk_norm)
        self.net.to(device=target.device, dtype=target.dtype)
        self._init_lm_head()  # a reduced vocabulary starts as ids 0..N−1 until fitted or loaded
        self.vocab_fitted = not reduced

    # -- draft vocabulary ------------------------------------------------------------------
    def set_vocab_mapping(self, token_counts: torch.Tensor) -> None:
        """Keep the ``draft_vocab_size`` most frequent target ids (token_counts [V] or shorter:
        missing ids count 0) and re-initialise the LM head from the target's rows."""
        if self.net.d2t is None:
            raise ValueError("set_vocab_mapping: this drafter uses the full vocabulary (draft_vocab_size = 0)")
        counts = torch.zeros(self.config.vocab_size, dtype=torch.float64, device=self.net.d2t.device)
        counts[: token_counts.numel()] = token_counts.to(counts)[: self.config.vocab_size]
        d2t, _ = build_vocab_mapping(counts, self.config.draft_vocab_size)
        self.net.d2t.copy_(d2t)
        self._init_lm_head()
        self.vocab_fitted = True

    def prepare_training(self, data) -> None:
        """Before training: build the draft vocabulary from the loss-masked tokens of ``data``
        (anything with flat ``ids`` and ``mask`` arrays, e.g. ``TrainData``); no-op when full."""
        if self.net.d2t is None:
            return
        ids = np.asarray(data.ids)[np.asarray(data.mask).astype(bool)]
        self.set_vocab_mapping(torch.from_numpy(np.bincount(ids.astype(np.int64), minlength=self.config.vocab_size)))

    @torch.no_grad()
    def _init_lm_head(self) -> None:
        """Start the draft LM head from the target's rows of the draft vocabulary."""
        head = self.target_head
        if head is None or head.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            return
        ids = self.net.draft_ids()
        rows = head.weight if ids is None else head.weight[ids]
        self.net.lm_head.weight.copy_(rows)

    # -- checkpoints -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, target: Target, **overrides: Any) -> Eagle3Drafter:
        drafter = super().from_pretrained(path, target, **overrides)
        ids = drafter.net.draft_ids()
        if ids is not None and not (
            bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < drafter.config.vocab_size
        ):
            raise DspecError(f"checkpoint {path}: d2t does not map to increasing ids of the target vocabulary")
        drafter.vocab_fitted = True
        return drafter

    # -- decoding --------------------------------------------------------------------------
    def init_state(self) -> Eagle3State:
        net, dev = self.net, self.target.device
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        cache = ContextCache(1, net.self_attn.kv_heads, net.self_attn.head_dim, dev, net.dtype)
        return Eagle3State(cache=cache, pending=torch.zeros(0, width, device=dev, dtype=net.dtype))

    @torch.no_grad()
    def add_requests(self, state: Eagle3State, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """Prefill: pairs (taps_t, prompt_{t+1}) for t < L−1; taps_{L−1} become pending."""
        if hidden is None or len(hidden) != len(prompts):
            raise ValueError(f"hidden: {self.name} needs the target's taps for every prompt")
        if any(h.shape[0] != p.numel() or p.numel() == 0 for h, p in zip(hidden, prompts, strict=True)):
            raise ValueError("hidden: need one row of taps per prompt token (non-empty prompts)")
        self._check_taps(hidden[0])
        dev = self.target.device
        old = state.cache.num_rows
        counts = torch.tensor([0] * old + [p.numel() - 1 for p in prompts], dtype=torch.long, device=dev)
        state.cache.add_rows(len(prompts))
        taps = torch.cat([h[:-1] for h in hidden])
        tokens = torch.cat([p[1:] for p in prompts]).to(dev)
        self._extend(state.cache, taps, tokens, counts, max(p.numel() for p in prompts))
        state.pending = torch.cat([state.pending, torch.stack([h[-1] for h in hidden]).to(state.pending.dtype)])

    def remove_requests(self, state: Eagle3State, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        state.cache.select_rows(index)
        state.pending = state.pending.index_select(0, index)

    @torch.no_grad()
    def advance(self, state: Eagle3State, committed, counts, hidden) -> None:
        """committed [Σc] (anchor + accepted drafts per row), counts [R], hidden [Σc, n·d]."""
        if hidden is None:
            raise ValueError(f"hidden: {self.name} needs the target's taps of committed tokens")
        self._check_taps(hidden)
        dev = self.target.device
        counts = counts.to(dev)
        total = hidden.shape[0]
        if total == 0:
            return
        ends = torch.cumsum(counts, 0)  # [R]
        rows = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=total)
        first = torch.arange(total, device=dev) == (ends - counts)[rows]  # [Σc]
        prev = torch.cat([hidden[:1], hidden[:-1]])  # taps of the previous committed token
        taps = torch.where(first[:, None], state.pending[rows].to(hidden.dtype), prev)
        self._extend(state.cache, taps, committed.to(dev), counts, int(counts.max()))
        last = hidden[(ends - 1).clamp(min=0)].to(state.pending.dtype)
        state.pending = torch.where((counts > 0)[:, None], last, state.pending)

    @torch.no_grad()
    def propose(self, state: Eagle3State, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        """Chain: ``max_len`` tokens sampled one by one with ``sampler`` (q_k = what x_k is drawn
        from, mapped to the full vocabulary). Tree (config ``tree``): an EAGLE-2 tree of depth
        <= max_len plus its best path as the chain."""
        R = state.cache.num_rows
        if anchors.shape != (R,):
            raise ValueError(f"anchors must be [R={R}], got {tuple(anchors.shape)}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if self.config.tree:
            return self._propose_tree(state, anchors, max_len)
        run = _Run(self, state)
        o = run.root(anchors)  # [R, 1, d]
        tokens, probs = [], []
        for k in range(max_len):
            q = sampler.probs(self._full_logits(self.net.logits(o[:, 0])))  # [R, V]
            x = sampler.sample(q, k)  # [R]
            tokens.append(x)
            probs.append(q)
            if k + 1 < max_len:
                o = run.step(x[:, None], o, run.chain_mask())
        return Proposal(
            tokens=torch.stack(tokens, 1),
            lengths=torch.full((R,), max_len, dtype=torch.long, device=anchors.device),
            draft_probs=torch.stack(probs, 1),
        )

    def _propose_tree(self, state: Eagle3State, anchors: torch.Tensor, max_len: int) -> Proposal:
        """EAGLE-2: expand the top-k frontier depth by depth, keep the best nodes overall."""
        cfg, R = self.config, anchors.shape[0]
        depth, k = min(cfg.tree_depth, max_len), cfg.tree_top_k
        run = _Run(self, state)
        o = run.root(anchors)  # [R, 1, d]
        logp, tok = torch.log_softmax(self.net.logits(o[:, 0]), -1).topk(k, dim=-1)  # [R, k]
        scores, tokens, parents = [logp], [tok], [torch.full_like(tok, -1)]  # candidates, depth-major
        front = torch.arange(k, device=anchors.device).expand(R, k)  # candidate index of each frontier node
        front_tok, front_score, front_o = tok, logp, o.expand(R, k, -1)
        front_proc = torch.zeros_like(tok)  # processed index of each frontier node's parent (0 = root)
        offset = k
        for _ in range(depth - 1):
            o = run.step(self._target_ids(front_tok), front_o, run.tree_mask(front_proc))  # [R, k, d]
            lp, t = torch.log_softmax(self.net.logits(o), -1).topk(k, dim=-1)  # [R, k, k]
            cand = (front_score[..., None] + lp).flatten(1)  # [R, k²]
            scores.append(cand)
            tokens.append(t.flatten(1))
            parents.append(front.repeat_interleave(k, dim=1))
            pick = cand.sort(dim=1, descending=True, stable=True).indices[:, :k]  # next frontier [R, k]
            front_proc = run.processed - k + pick // k
            front, front_tok = offset + pick, t.flatten(1).gather(1, pick)
            front_score, front_o = cand.gather(1, pick), o.gather(1, (pick // k)[..., None].expand(-1, -1, o.shape[-1]))
            offset += k * k
        scores, tokens, parents = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
        tree_tokens, tree_parents, tree_scores = select_tree(scores, tokens, parents, cfg.tree_total_tokens - 1)
        tree_tokens = self._target_ids(tree_tokens)
        path, lengths = best_path(tree_tokens, tree_parents, tree_scores, depth)
        n = tree_tokens.shape[1]
        tree = DraftTree(tokens=tree_tokens, parents=tree_parents, num_nodes=torch.full((R,), n, device=anchors.device))
        return Proposal(tokens=path, lengths=lengths, tree=tree)

    # -- helpers ---------------------------------------------------------------------------
    @torch.no_grad()
    def frozen_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding, never trained through."""
        return self.embed(ids)

    def _extend(self, cache: ContextCache, taps, tokens, counts, max_count: int) -> None:
        """Append K/V of pairs (taps [N, n·d], next tokens [N]) at each row's next positions."""
        rows, pos = cache.slots(counts, tokens.shape[0], max_count)
        a = self.net.inputs(self.embed(tokens), self.net.fuse(taps))
        cos, sin = self.net.rope(pos)
        cache.write(rows, pos, [self.net.project_kv(a, cos, sin)], counts)

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t = self.net.d2t
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [R, N] -> target-vocabulary logits [R, V] (−inf elsewhere)."""
        ids = self.net.draft_ids()
        if ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, ids, logits)

    def _target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The frozen target head (with its final-logit softcap, if any) -> float logits."""
        z = self.target_head(last_hidden.to(self.target_head.weight.dtype)).float()
        return z if not self.softcap else self.softcap * torch.tanh(z / self.softcap)

    def _check_taps(self, taps: torch.Tensor) -> None:
        want = len(self.config.target_layer_ids) * self.config.hidden_size
        if taps.shape[-1] != want:
            raise ValueError(f"hidden: expected taps of width {want} (target_layer_ids x hidden), got {taps.shape[-1]}")

    # -- training --------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, torch.Tensor], target_features: dict[str, torch.Tensor]) -> dict:
        """Training-time test over every position (see :mod:`dspec_eagle3.loss`).

        batch {"input_ids", "loss_mask", "attention_mask"} [b, L]; target_features {"taps"
        [b, L, n·d], "last_hidden" [b, L, d]}. Returns {"loss", "acc@k", "accept_rate@k"
        (k = 1..ttt_length), "tau_probabilistic", "tokens"}.
        """
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        att = batch.get("attention_mask", torch.ones_like(ids))
        taps, last = target_features["taps"], target_features["last_hidden"]
        if ids.dim() != 2 or loss_mask.shape != ids.shape or att.shape != ids.shape:
            raise ValueError("batch input_ids / loss_mask / attention_mask must all be [b, L]")
        if taps.shape[:2] != ids.shape or last.shape[:2] != ids.shape:
            raise ValueError("target_features taps / last_hidden must be [b, L, ·] like input_ids")
        self._check_taps(taps)
        if not self.vocab_fitted:
            raise DspecError(
                f"draft_vocab_size {self.config.draft_vocab_size}: the draft vocabulary is not built yet; call "
                "prepare_training(data) (or set_vocab_mapping(token_counts)) before training"
            )
        impl = self.config.attention
        if impl == "auto":
            impl = "flex" if ids.is_cuda else "dense"
        outs = ttt_outputs(self.net, self.frozen_embed, ids, taps, att, self.config.ttt_length, impl)
        return ttt_losses(self.net, outs, self._target_logits, last, loss_mask, self.config.loss_decay)


class _Run:
    """One round's draft forwards over the committed cache plus local draft K/V (step 0 is the
    root at position n−1; each later forward is one level deeper)."""

    def __init__(self, drafter: Eagle3Drafter, state: Eagle3State):
        self.drafter, self.net, self.cache, self.pending = drafter, drafter.net, state.cache, state.pending
        self.base = state.cache.lengths  # [R] position of the root step (n − 1)
        self.keys: list[torch.Tensor] = []  # per forward [R, Hkv, Q, hd]
        self.values: list[torch.Tensor] = []
        self.anc: torch.Tensor | None = None  # [R, P, P] bool: processed node i sees node j (trees)

    @property
    def processed(self) -> int:
        """Local nodes with K/V so far (P)."""
        return sum(k.shape[2] for k in self.keys)

    def root(self, anchors: torch.Tensor) -> torch.Tensor:
        """Step 0: (fc(pending), anchor) at position n−1 -> o [R, 1, d]."""
        self.anc = torch.ones(anchors.shape[0], 1, 1, dtype=torch.bool, device=anchors.device)
        return self.step(anchors[:, None], self.net.fuse(self.pending)[:, None], self.anc)

    def chain_mask(self) -> torch.Tensor:
        """[R, 1, P+1]: a chain step sees every earlier draft step and itself."""
        return torch.ones(self.cache.num_rows, 1, self.processed + 1, dtype=torch.bool, device=self.base.device)

    def tree_mask(self, parent: torch.Tensor) -> torch.Tensor:
        """parent [R, Q]: processed index of each new node's parent -> [R, Q, P+Q] (ancestors and
        self); the new rows are kept for deeper levels."""
        R, Q = parent.shape
        P, anc = self.processed, self.anc
        assert anc is not None  # set by root()
        rows = anc.gather(1, parent[..., None].expand(R, Q, P))  # [R, Q, P]
        new = torch.cat([rows, torch.eye(Q, dtype=torch.bool, device=parent.device).expand(R, Q, Q)], dim=2)
        self.anc = torch.cat([torch.cat([anc, anc.new_zeros(R, P, Q)], dim=2), new], dim=1)
        return new

    def step(self, tokens: torch.Tensor, g: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
        """Q nodes per row one level deeper: target tokens [R, Q], g [R, Q, d], visibility of the
        local nodes [R, Q, P+Q] -> o [R, Q, d]."""
        R, Q = tokens.shape
        net = self.net
        pos = (self.base + len(self.keys))[:, None].expand(R, Q)  # depth = forwards so far
        a = net.inputs(self.drafter.embed(tokens), g)
        cos, sin = net.rope(pos)
        k, v = net.project_kv(a, cos, sin)
        self.keys.append(k.transpose(1, 2))
        self.values.append(v.transpose(1, 2))
        keys = torch.cat([self.cache.keys[0], *self.keys], dim=2)
        values = torch.cat([self.cache.values[0], *self.values], dim=2)
        mask = torch.cat([self.cache.visible()[:, None, :].expand(R, Q, -1), local_mask], dim=2)[:, None]
        return net.layer(a, g, cos, sin, keys, values, mask)

