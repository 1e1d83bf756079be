"""``prompt-lookup``: training-free n-gram drafts copied from the request's own context.

The last n tokens (anchor included) are searched for earlier in the context, longest n
first; the tokens that followed the most recent match with a whole draft after it become the
draft (else those after the earliest match, the longest there is: in a repeating loop the most
recent match sits one period back and would cut the draft to the period). Drafts are
deterministic (one-hot), so verification accepts x with probability p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspec_cli import (
    PAD,
    Drafter,
    DrafterConfig,
    DraftState,
    DspecError,
    Proposal,
    Sampler,
    hookimpl,
)


@dataclass
class PromptLookupConfig(DrafterConfig):
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.min_ngram <= self.max_ngram:

            raise DspecError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


def lookup(context: torch.Tensor, max_len: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Draft for one request: context [L] (ending with the anchor) -> draft [≤ max_len]."""
    L = context.numel()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail = context[L - n :]
        windows = context[: L - 1].unfold(0, n, 1)  # [L-n, n] n-grams that have a successor
        hits = (windows == tail).all(-1).nonzero().squeeze(1)
        if hits.numel():
            full = hits[hits + n + max_len <= L]  # matches followed by a whole draft
            start = int(full[-1] if full.numel() else hits[0]) + n
            return context[start : start + max_len]
    return context[:0]


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    config_class = PromptLookupConfig
    config: PromptLookupConfig
    capabilities = frozenset()
    description = "n-gram match in the request's context (training-free)"

    def propose(self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        R = anchors.shape[0]
        tokens = torch.full((R, max_len), PAD, dtype=torch.long)
        lengths = torch.zeros(R, dtype=torch.long)
        for r, anchor in enumerate(anchors.tolist()):
            ctx = torch.cat([state.context[r], torch.tensor([anchor])])
            draft = lookup(ctx, max_len, self.config.max_ngram, self.config.min_ngram)
            tokens[r, : draft.numel()] = draft
            lengths[r] = draft.numel()
        return Proposal(tokens=tokens.to(anchors.device), lengths=lengths.to(anchors.device))


@hookimpl
def dspec_register_drafters(register):
    register(PromptLookupDrafter)
