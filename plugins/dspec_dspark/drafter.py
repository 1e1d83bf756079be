"""DSpark's proposer: the DFlash backbone's one parallel forward, then the block drawn left to
right through the sequential head (paper §3.1), each slot's logits U_k plus a bias from the
token drawn before it (Markov head) or from the whole block prefix (gated RNN head)."""

from __future__ import annotations

import torch
from dspec_dflash import BlockDraftState, DFlashDrafter

from dspec_cli import Proposal, Sampler


class DSparkDrafter(DFlashDrafter):
    """A block drafter with a sequential head (``head`` markov or rnn) and a confidence head;
    everything but :meth:`propose` is the shared block drafter's (``dspec_dflash``)."""

    @torch.no_grad()
    def propose(self, state: BlockDraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        """min(max_len, γ) drafts after ``anchors`` [R], left to right: x_k is drawn from q_k =
        sampler.probs(U_k + head bias(x_{k−1}, head state)); greedy runs take the argmax and carry
        no distribution. The confidence c_k uses h_k and x_{k−1} only (never x_k)."""
        h = self.block_hidden(state, anchors)[:, : min(max_len, self.config.block_size)]  # [R, γ, d]
        base = self.lm_logits(h)  # [R, γ, V]: one LM-head matmul for the whole block
        prev, head_state = anchors, None
        tokens, qs = [], []
        for k in range(h.shape[1]):
            logits, head_state = self.head_logits(base[:, k], h[:, k], prev, head_state)  # [R, V]
            if sampler.greedy:
                prev = logits.argmax(-1)
            else:
                q = sampler.probs(logits)  # [R, V]
                prev = sampler.sample(q, k)
                qs.append(q)
            tokens.append(prev)
        probs = torch.stack(qs, 1) if qs else None  # [R, γ, V]
        return self.block_proposal(h, anchors, torch.stack(tokens, 1), probs)
