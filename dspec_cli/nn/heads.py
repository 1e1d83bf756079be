"""DSpark's sequential heads and confidence head (paper §3.1-3.2.1; DeepSpec
``deepspec/modeling/dspark/markov_head.py``).

A sequential head turns the backbone's independent per-slot logits U_k into a left-to-right
block distribution: logits_k = U_k + W2 · f_k, where the rank-r feature f_k depends on the
previous token x_{k−1} (slot 0: the anchor) and, for the RNN, on a recurrent state.

* :class:`MarkovHead`: f_k = W1[x_{k−1}] (paper eq. 5, B = W1·W2 of rank r).
* :class:`RNNHead`: z_k = [s_{k−1}; W1[x_{k−1}]; h_k], one linear map split into gate /
  candidate / output, s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh(c), f_k = tanh(o) (paper eq. 6, s_0 = 0;
  the output uses z_k, the new state only feeds step k+1).
* :class:`ConfidenceHead`: logit_k = w·[h_k; W1[x_{k−1}]] + b (paper eq. 7). It never sees x_k,
  so scheduling on it is non-anticipating.

Training unrolls with teacher-forced previous tokens (:meth:`SequentialHead.block_features`);
inference steps with the sampled ones (:meth:`SequentialHead.step_bias`). On a CPU the Markov
head's bias for a small vocabulary is a row of the transition table W1·W2 [V, V], computed once
per weight version: one row lookup per step instead of reading W2 (a matrix-vector product
bound by memory bandwidth: ~0.25 ms per step for V = 8192, r = 256 in float32).
"""

from __future__ import annotations

import torch
from torch import nn

from dspec_cli.nn.linear import Linear

__all__ = ["ConfidenceHead", "MarkovHead", "RNNHead", "SequentialHead", "build_head"]


class SequentialHead(nn.Module):
    """W1: previous-token embedding [V, r]; W2: rank-r logit projection r → V (no bias)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        self.embed = nn.Embedding(vocab_size, rank)  # W1
        self.proj = Linear(rank, vocab_size, bias=False)  # W2

    def init_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        """The state before slot 0 of ``rows`` rows (None: a stateless head), on like's [..., d]
        device and dtype."""
        return None

    def step(self, state: torch.Tensor | None, prev: torch.Tensor,
             h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """state [R, r] or None, prev [R] tokens x_{k−1}, h [R, d] -> (feature f_k [R, r], next state)."""
        raise NotImplementedError

    def block_features(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Teacher-forced unroll: prev [..., B], h [..., B, d] -> f [..., B, r]."""
        state = self.init_state(prev[..., 0].numel(), h)
        if state is not None:
            state = state.view(*prev.shape[:-1], self.rank)
        feats = []
        for k in range(prev.shape[-1]):
            f, state = self.step(state, prev[..., k], h[..., k, :])
            feats.append(f)
        return torch.stack(feats, dim=-2)

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """features f [..., r] -> logit bias [..., V]."""
        return self.proj(features)

    def step_bias(self, state: torch.Tensor | None, prev: torch.Tensor,
                  h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoding step: state [..., r] or None, prev [...] tokens, h [..., d] -> (logit bias
        [..., V], next state)."""
        feat, state = self.step(state, prev, h)
        return self.bias(feat), state


TABLE_MAX_BYTES = 256 << 20  # largest cached Markov transition table (V = 8192 in float32)


class MarkovHead(SequentialHead):
    """First-order low-rank transition bias W2(W1[x_{k−1}]); independent of h_k."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self._table: tuple[tuple, torch.Tensor] | None = None  # (weight versions, W1·W2 [V, V])

    def step(self, state, prev, h):  # see SequentialHead.step: prev [R], h [R, d] -> (f [R, r], None)
        return self.embed(prev), None

    def step_bias(self, state, prev, h):  # prev [...], h [..., d] -> (bias [..., V], None)
        table = self.transition_table()
        if table is None:
            return super().step_bias(state, prev, h)
        return table.index_select(0, prev.reshape(-1)).view(*prev.shape, -1), None

    def transition_table(self) -> torch.Tensor | None:
        """The bias of every previous token [V, V] (row x = W2·W1[x]) when decoding eagerly on a CPU
        with a table of at most TABLE_MAX_BYTES; rebuilt whenever a weight changes (training)."""
        w1, w2 = self.embed.weight, self.proj.weight
        if (torch.is_grad_enabled() or torch.compiler.is_compiling() or w1.device.type != "cpu"
                or w1.shape[0] ** 2 * w2.element_size() > TABLE_MAX_BYTES):
            return None
        key = (w1._version, w2._version, w1.data_ptr(), w2.data_ptr(), w2.dtype)
        if self._table is None or self._table[0] != key:
            self._table = (key, self.proj(w1))  # [V, V]
        return self._table[1]

    def block_features(self, prev, h):  # prev [..., B], h [..., B, d] -> f [..., B, r]
        return self.embed(prev)


class RNNHead(SequentialHead):
    """Gated recurrent bias over the block prefix (paper eq. 6)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.gates = Linear(2 * rank + hidden_size, 3 * rank)  # [W_g; W_c; W_o] with bias

    def init_state(self, rows, like):  # -> zeros [rows, r] like like's [..., d]
        return like.new_zeros(rows, self.rank)

    def step(self, state, prev, h):  # state [R, r], prev [R], h [R, d] -> (f [R, r], state [R, r])
        assert state is not None  # init_state gives zeros
        z = torch.cat([state, self.embed(prev).to(h.dtype), h], dim=-1)
        g, c, o = self.gates(z).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        return torch.tanh(o), gate * state + (1 - gate) * torch.tanh(c)


class ConfidenceHead(nn.Module):
    """c_k = σ(w·[h_k; W1[x_{k−1}]] + b); returns the logit (sigmoid applied by the caller)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.linear = Linear(hidden_size + rank, 1)

    def forward(self, h: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """h [..., d], prev_embed [..., r] (None without a sequential head) -> logits [...]."""
        x = h if prev_embed is None else torch.cat([h, prev_embed.to(h.dtype)], dim=-1)
        return self.linear(x).squeeze(-1)


def build_head(kind: str, vocab_size: int, rank: int, hidden_size: int) -> SequentialHead | None:
    """``"none"`` -> None, ``"markov"`` -> :class:`MarkovHead`, ``"rnn"`` -> :class:`RNNHead`."""
    heads = {"none": None, "markov": MarkovHead, "rnn": RNNHead}
    if kind not in heads:
        raise ValueError(f"head must be one of {', '.join(heads)}, got {kind!r}")
    cls = heads[kind]
    return None if cls is None else cls(vocab_size, rank, hidden_size)
