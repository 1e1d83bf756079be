"""``draft-model``: a separate small causal LM sharing the target's tokenizer (Leviathan et al.).

The draft model drafts autoregressively with its own batched KV cache (a second
:class:`~dspec_cli.runtime.target.Target`), sampling each token at the run's settings and returning
its full distribution q_k, so verification uses lossless rejection sampling. After
verification the draft cache is rolled back to the committed prefix.

Models of one family often pad their embedding tables differently (Qwen2.5-0.5B has 151,936
rows, Qwen2.5-7B 152,064, one tokenizer): what must agree is the tokenizer, not the row count.
The draft's logits are cut to the target's rows, or extended with −inf (zero probability) up
to them, so q_k lives on the target's vocabulary; the rows past the tokenizer's ids are
padding in both models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dspec_cli import (
    Capability,
    Drafter,
    DrafterConfig,
    DraftState,
    DspecError,
    Proposal,
    Sampler,
    Target,
    embedded_path,
    hookimpl,
)


@dataclass
class DraftModelConfig(DrafterConfig):
    model: str = ""  # local path or Hub id of the draft LM; "" = the embedded tiny draft model
    dtype: str = "auto"


@dataclass
class DraftModelState(DraftState):
    batch: Any = None  # the draft model's TargetBatch
    pending: list[torch.Tensor] = field(default_factory=list)  # committed ids not yet in the draft cache, per row
    fed: int = -1  # drafts fed into the draft cache by the last propose (-1: none this round)


def check_same_vocabulary(draft: Target, target: Target) -> None:
    """Draft and target must share token ids: the same tokenizer vocabulary, every id of which
    both models embed (their padded rows may differ); without both tokenizers, the same size."""
    if draft.tokenizer is None or target.tokenizer is None:
        if draft.vocab_size != target.vocab_size:
            raise DspecError(f"draft model vocabulary ({draft.vocab_size}) does not match the target's "
                             f"({target.vocab_size}) and without both tokenizers the token ids cannot be compared")
        return
    vocab = target.tokenizer.get_vocab()
    if draft.tokenizer.get_vocab() != vocab:
        raise DspecError("draft model tokenizer differs from the target's tokenizer (token ids would not match)")
    ids = max(vocab.values(), default=-1) + 1
    for who, model in (("draft model", draft), ("target", target)):
        if model.vocab_size < ids:
            raise DspecError(f"the {who} embeds {model.vocab_size} token ids, fewer than its tokenizer's {ids}")


def to_vocabulary(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Logits [R, V_d] on ``size`` rows: padding rows past ``size`` cut, missing rows at −inf."""
    extra = size - logits.shape[-1]
    if extra <= 0:
        return logits[:, :size]
    return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], dim=-1)


class DraftModelDrafter(Drafter):
    name = "draft-model"
    config_class = DraftModelConfig
    config: DraftModelConfig
    capabilities = frozenset({Capability.draft_probs})
    description = "a separate small causal LM sharing the tokenizer (classic speculative sampling)"

    def __init__(self, config: DraftModelConfig, target: Target, model: Target | None = None):
        super().__init__(config, target)
        if model is None:
            path = config.model or str(embedded_path("tiny-draft-model"))
            model = Target.load(path, dtype=config.dtype, device=target.device)
        check_same_vocabulary(model, target)
        self.model = model

    @classmethod
    def from_pretrained(cls, path, target: Target, **overrides) -> DraftModelDrafter:
        """A draft-model "checkpoint" is the draft LM itself: a local path or Hub id."""
        return cls(DraftModelConfig(model=str(path), **overrides), target)

    def save_pretrained(self, path) -> None:
        """The draft LM itself (weights and tokenizer): what :meth:`from_pretrained` reads."""
        self.model.model.save_pretrained(path)
        if self.model.tokenizer is not None:
            self.model.tokenizer.save_pretrained(path)

    def init_state(self) -> DraftModelState:
        return DraftModelState(batch=self.model.new_batch())

    def add_requests(self, state: DraftModelState, prompts: list[torch.Tensor],
                     hidden: list[torch.Tensor] | None) -> None:
        super().add_requests(state, prompts, hidden)
        self.model.prefill(state.batch, [p.tolist() for p in prompts])
        state.pending.extend(p[:0] for p in prompts)

    def remove_requests(self, state: DraftModelState, keep: list[int]) -> None:
        super().remove_requests(state, keep)
        self.model.select_rows(state.batch, keep)
        state.pending = [state.pending[r] for r in keep]

    def propose(self, state: DraftModelState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        R = anchors.shape[0]
        # first step feeds what the draft cache lacks: pending committed ids + the anchor, padded rows
        counts = [p.numel() + 1 for p in state.pending]
        ids = anchors.new_zeros(R, max(counts))
        for r in range(R):
            ids[r, : counts[r]] = torch.cat([state.pending[r], anchors[r : r + 1]])
        ids = ids.clamp(max=self.model.vocab_size - 1)  # a target id past the draft's rows is padding
        logits = self.model.append(state.batch, ids, counts)  # [R, V_d]
        tokens, probs = [], []
        for k in range(max_len):
            q = sampler.probs(to_vocabulary(logits, self.target.vocab_size))  # [R, V]
            x = sampler.sample(q, k)  # [R]
            tokens.append(x)
            probs.append(q)
            if k + 1 < max_len:
                logits = self.model.append(state.batch, x[:, None], [1] * R)
        state.pending = [t[:0] for t in state.pending]
        state.fed = max_len - 1
        return Proposal(
            tokens=torch.stack(tokens, 1),
            lengths=torch.full((R,), max_len, dtype=torch.long, device=anchors.device),
            draft_probs=torch.stack(probs, 1),
        )

    def advance(self, state: DraftModelState, committed, counts, hidden) -> None:
        super().advance(state, committed, counts, hidden)
        chunks = torch.split(committed, counts.tolist())
        if state.fed < 0:  # no propose this round: everything committed is still missing
            state.pending = [torch.cat([p, c]) for p, c in zip(state.pending, chunks, strict=True)]
            return
        kept = (counts - 1).clamp(max=state.fed)  # fed drafts that were accepted
        kept_list = kept.tolist()
        self.model.rollback(state.batch, [state.fed - k for k in kept_list])  # drop rejected drafts from the draft cache
        state.pending = [c[1 + k :] for c, k in zip(chunks, kept_list, strict=True)]
        state.fed = -1


@hookimpl
def dspec_register_drafters(register):
    register(DraftModelDrafter)
