"""Toy models with exact distributions: :class:`ToyLM`, a first-order Markov chain over a small
vocabulary whose next-token distribution goes through
:func:`~dspec_cli.core.sampling.logits_to_probs` (so its exact joint is cheap,
:func:`exact_target_joint`), and :class:`ToyDrafter`, which proposes γ tokens autoregressively
from another chain, with q and non-anticipating confidences."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspec_cli.core.sampling import SamplingConfig, logits_to_probs
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.drafter import heuristic_confidence


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row by inverse CDF: probs [N, V] (unnormalised is fine) -> [N] long.

    Independent of the verifier's exponential-race sampler; zero-probability tokens are never drawn.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64).clamp_(min=2.0**-60)
    return (cdf < u * cdf[:, -1:]).sum(-1)


@dataclass(frozen=True, kw_only=True)
class ToyLM(SamplingConfig):
    """First-order Markov chain LM: next-token logits depend only on the previous token.

    The sampling settings (the inherited fields) are part of the model: ``probs`` is the
    distribution a lossless decoder must reproduce.
    """

    transition_logits: torch.Tensor  # [V, V]; row = previous token

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.transition_logits
        if t.dim() != 2 or t.shape[0] != t.shape[1]:
            raise ValueError(f"transition_logits must be [V, V], got shape {tuple(t.shape)}")

    @classmethod
    def random(cls, vocab_size: int, *, scale: float = 2.0, generator: torch.Generator, **sampling) -> ToyLM:
        """Gaussian logits with standard deviation ``scale`` (larger = more peaked)."""
        return cls(transition_logits=scale * torch.randn(vocab_size, vocab_size, generator=generator), **sampling)

    @classmethod
    def iid(cls, logits: torch.Tensor, **sampling) -> ToyLM:
        """Every position has the same next-token logits [V] (an i.i.d. source)."""
        return cls(transition_logits=logits.float().expand(logits.shape[-1], -1).clone(), **sampling)

    @classmethod
    def from_probs(cls, probs: torch.Tensor, **sampling) -> ToyLM:
        """i.i.d. source ([V]) or chain ([V, V]) with the given probabilities (zeros stay zero)."""
        logits = probs.double().log().float()
        return cls.iid(logits, **sampling) if logits.dim() == 1 else cls(transition_logits=logits, **sampling)

    @property
    def vocab_size(self) -> int:
        return self.transition_logits.shape[0]

    def probs(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Next-token probabilities [N, V] after prev_tokens [N], at the model's sampling settings."""
        return logits_to_probs(self.transition_logits, self.temperature, self.top_k, self.top_p)[prev_tokens]


@dataclass(frozen=True)
class ToyDrafter:
    """Autoregressive drafter over a :class:`ToyLM`.

    greedy=True proposes the argmax and no draft probs (one-hot verification). Confidences
    are non-anticipating: c_k = confidence_table[x_{k-1}] (a Markov confidence head; x_0 is
    the anchor) or, without a table, the Σq² heuristic of q_k's shape.
    """

    model: ToyLM
    greedy: bool = False
    confidence_table: torch.Tensor | None = None  # [V]

    def propose(self, anchors: torch.Tensor, gamma: int, generator: torch.Generator | None) -> Proposal:
        """γ draft tokens after each anchor [R]."""
        prev = anchors
        tokens, probs, conf = [], [], []
        for _ in range(gamma):
            q = self.model.probs(prev)  # [R, V]
            x = q.argmax(-1) if self.greedy else sample_categorical(q, generator)
            if self.confidence_table is not None:
                conf.append(self.confidence_table[prev])
            tokens.append(x)
            probs.append(q)
            prev = x
        q_all = torch.stack(probs, 1)  # [R, γ, V]
        lengths = torch.full_like(anchors, gamma)
        confidence = (
            torch.stack(conf, 1).float()
            if self.confidence_table is not None
            else heuristic_confidence(q_all, lengths, gamma)
        )
        return Proposal(
            tokens=torch.stack(tokens, 1),
            lengths=lengths,
            draft_probs=None if self.greedy else q_all,
            confidence=confidence,
        )



def exact_target_joint(target: ToyLM, x0: int, num_tokens: int) -> torch.Tensor:
    """Exact joint of the first num_tokens tokens after x0: float64 tensor of shape [V]*num_tokens."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    table = target.probs(torch.arange(target.vocab_size)).double()  # [V, V]
    joint = table[x0]
    for _ in range(num_tokens - 1):
        joint = joint.unsqueeze(-1) * table  # [..., t_{k-1}, t_k]
    return joint

