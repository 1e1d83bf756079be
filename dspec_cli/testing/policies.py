"""Length policies, the scheduler hook of the simulations: a policy sees a
:class:`~dspec_cli.core.types.Proposal` (tokens, draft probs, confidences) and returns ℓ_r ∈ [0, γ].
:func:`throughput_length_policy` gives the causal early-stop scheduler and the retrospective
global search of the paper's Appendix A (:func:`appendix_a` builds that setting: the
retrospective one yields (0.85, 0.15) instead of the target's (0.7, 0.3))."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dspec_cli.core.types import Proposal
from dspec_cli.testing.toy import ToyDrafter, ToyLM

LengthPolicy = Callable[[Proposal], torch.Tensor]


def fixed_length_policy(length: int) -> LengthPolicy:
    """ℓ_r = min(length, γ) for every request."""
    return lambda prop: torch.full_like(prop.lengths, length).clamp(max=prop.tokens.shape[1])


def random_length_policy(generator: torch.Generator) -> LengthPolicy:
    """ℓ_r uniform on [0, γ], independent of the proposal (causal; exercises ragged layouts)."""
    return lambda prop: torch.randint(0, prop.tokens.shape[1] + 1, prop.lengths.shape, generator=generator)


def throughput_length_policy(sps: Sequence[float], *, early_stop: bool = True) -> LengthPolicy:
    """Per-request throughput scheduler of the paper's Algorithm 1 (each request its own batch).

    With survivals a_j = c_1·…·c_j, the expected throughput of verifying ℓ drafts is
    Θ_ℓ = (1 + a_1 + … + a_ℓ)·SPS(ℓ+1), where ``sps[i]`` = SPS(i+1). early_stop=True admits
    positions while Θ keeps improving (causal: ℓ ≥ k depends on c_≤k, hence on x_<k only).
    early_stop=False takes the global argmax over ℓ (the retrospective search of Appendix A:
    admitting x_k can depend on c_{k+1}, which depends on x_k itself, so it is biased).
    """
    sps_t = torch.as_tensor(list(sps), dtype=torch.float64)

    def policy(prop: Proposal) -> torch.Tensor:
        gamma = prop.tokens.shape[1]
        if prop.confidence is None:
            raise ValueError("throughput_length_policy needs proposal.confidence")
        if sps_t.numel() < gamma + 1:
            raise ValueError(f"sps needs gamma + 1 = {gamma + 1} entries, got {sps_t.numel()}")
        survival = prop.confidence.double().cumprod(1)  # [R, γ]
        gain = torch.cat([torch.ones_like(survival[:, :1]), 1 + survival.cumsum(1)], 1)  # [R, γ+1]
        theta = gain * sps_t[: gamma + 1]
        if not early_stop:
            return theta.argmax(1)
        improving = theta[:, 1:] > theta[:, :-1]  # [R, γ]
        return improving.long().cumprod(1).sum(1)

    return policy


@dataclass(frozen=True)
class AppendixA:
    """The paper's Appendix A counterexample (vocabulary A=0, B=1, plus the anchor S=2)."""

    target: ToyLM  # p_t = (0.7, 0.3) at every position
    drafter: ToyDrafter  # p_d = (0.5, 0.5); confidence c_1 = 0.8 after S, c_2 = 0.9 after A, 0 after B
    anchor: int
    gamma: int
    sps: tuple[float, ...]  # SPS(1), SPS(2), SPS(3)
    target_first: torch.Tensor  # [3] exact first-token distribution (0.7, 0.3, 0)
    retrospective_first: torch.Tensor  # [3] what the retrospective scheduler yields (0.85, 0.15, 0)

    def causal_policy(self) -> LengthPolicy:
        """Early stop: Θ_1 = 0.9 < Θ_0 = 1, so ℓ = 0 before looking at x_1."""
        return throughput_length_policy(self.sps, early_stop=True)

    def retrospective_policy(self) -> LengthPolicy:
        """Global search: ℓ = 2 if x_1 = A (Θ_2 = 1.134), else 0."""
        return throughput_length_policy(self.sps, early_stop=False)


def appendix_a() -> AppendixA:
    """Build the Appendix A setting."""
    return AppendixA(
        target=ToyLM.from_probs(torch.tensor([0.7, 0.3, 0.0])),
        drafter=ToyDrafter(ToyLM.from_probs(torch.tensor([0.5, 0.5, 0.0])), confidence_table=torch.tensor([0.9, 0.0, 0.8])),
        anchor=2,
        gamma=2,
        sps=(1.0, 0.5, 0.45),
        target_first=torch.tensor([0.7, 0.3, 0.0], dtype=torch.float64),
        retrospective_first=torch.tensor([0.85, 0.15, 0.0], dtype=torch.float64),
    )

