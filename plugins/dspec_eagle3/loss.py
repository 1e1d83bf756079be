"""EAGLE-3's training-time test (TTT): unrolled draft steps and their soft cross-entropy.

Step 0 reads the fused target features g_t with token x_{t+1}; step j > 0 reads the draft's
own step-(j−1) output at the same index t with token x_{t+1+j}, at RoPE position t + j.
Step j at index t predicts x_{t+2+j}, supervised by the target's distribution at position
t+1+j. Attention (:func:`~dspec_eagle3.model.ttt_attention_mask`): causal over step-0 keys
plus the same-index key of every earlier step, exactly what chain drafting sees at inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspec_eagle3.model import Eagle3Net, ttt_attention_mask


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [b, L] shifted left by s, zero (False) filled: out[:, t] = x[:, t + s]."""
    return F.pad(x[:, s:], (0, min(s, x.shape[1])))


def ttt_outputs(
    net: Eagle3Net,
    embed: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,  # [b, L]
    taps: torch.Tensor,  # [b, L, n·d]
    attention_mask: torch.Tensor,  # [b, L]
    steps: int,
    attention: str = "dense",
) -> list[torch.Tensor]:
    """Draft outputs o_j [b, L, d] (pre-norm, the next step's g) for steps j = 0..steps−1;
    ``attention``: dense SDPA masks, or FlexAttention block masks ("flex")."""
    b, L = input_ids.shape
    key_valid = attention_mask.bool()
    pos = torch.arange(L, device=input_ids.device).expand(b, L)
    g = net.fuse(taps)
    keys, values, outs = [], [], []
    for j in range(steps):
        a = net.inputs(embed(_shift(input_ids, 1 + j)), g)
        cos, sin = net.rope(pos + j)
        k, v = net.project_kv(a, cos, sin)  # [b, L, Hkv, hd]
        keys.append(k.transpose(1, 2))
        values.append(v.transpose(1, 2))
        mask = ttt_attention_mask(key_valid, j, attention)
        g = net.layer(a, g, cos, sin, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        outs.append(g)
    return outs


def ttt_losses(
    net: Eagle3Net,
    outs: list[torch.Tensor],  # per step [b, L, d]
    target_logits: Callable[[torch.Tensor], torch.Tensor],  # last_hidden rows [M, d] -> [M, V] float
    last_hidden: torch.Tensor,  # [b, L, d]
    loss_mask: torch.Tensor,  # [b, L] 1 = the token at this index is supervised
    decay: float,
) -> dict:
    """Σ_j decay^j · mean soft CE of step j, −Σ_v p_t(v) log q_j(v).

    p_t is the target's softmax, restricted to the draft vocabulary and renormalised when it is
    reduced; positions whose target argmax lies outside the draft vocabulary are skipped (as
    EAGLE does). Plain-float metrics (the training loop averages scalars), k = j + 1:
    ``acc@k`` (draft argmax = target argmax), ``accept_rate@k`` (mean Σ_v min(p_t, q_j) =
    1 − TV, q_j mapped to the full vocabulary, T = 1), ``tau_probabilistic`` = 1 + Σ_k Π_{i<=k}
    accept_rate@i, ``tokens`` = supervised positions of step 0.
    """
    b, L = loss_mask.shape
    ids = net.draft_ids()  # [N] or None
    with torch.no_grad():
        need = _shift(loss_mask.bool(), 1)  # the target distribution at s predicts token s+1
        rows = need.nonzero()  # [M, 2]
        z = target_logits(last_hidden[rows[:, 0], rows[:, 1]])  # [M, V]
        zsel = z if ids is None else z[:, ids]  # [M, N]
        p = torch.softmax(zsel, dim=-1)  # the training target
        p_full = p if ids is None else (zsel - torch.logsumexp(z, dim=-1, keepdim=True)).exp()
        good = torch.zeros_like(need)
        if ids is None:
            good[rows[:, 0], rows[:, 1]] = True
        else:
            in_draft = torch.zeros(z.shape[-1], dtype=torch.bool, device=z.device)
            in_draft[ids] = True
            good[rows[:, 0], rows[:, 1]] = in_draft[z.argmax(-1)]
        del z, zsel
        row_of = torch.full((b, L), -1, dtype=torch.long, device=p.device)
        row_of[rows[:, 0], rows[:, 1]] = torch.arange(rows.shape[0], device=p.device)
    loss = torch.zeros((), device=loss_mask.device)
    stats = []
    for j, o in enumerate(outs):
        where = _shift(good, 1 + j).nonzero()  # queries t whose target (position t+1+j) is usable
        logq = torch.log_softmax(net.logits(o[where[:, 0], where[:, 1]]), dim=-1)  # [M_j, N]
        r = row_of[where[:, 0], where[:, 1] + 1 + j]  # [M_j]
        pj = p[r]
        count = max(where.shape[0], 1)
        loss = loss + decay**j * -(pj * logq).sum() / count
        with torch.no_grad():
            acc = (logq.argmax(-1) == pj.argmax(-1)).float().sum() / count
            rate = torch.minimum(logq.exp(), p_full[r]).sum() / count
        stats.append(torch.stack([acc, rate, torch.tensor(float(where.shape[0]), device=acc.device)]))
    acc, rate, tokens = torch.stack(stats).T.tolist()  # metrics to the host in one transfer
    out: dict[str, torch.Tensor | float] = {"loss": loss}
    out.update({f"acc@{j + 1}": a for j, a in enumerate(acc)})
    out.update({f"accept_rate@{j + 1}": a for j, a in enumerate(rate)})
    out.update(tau_probabilistic=1.0 + float(torch.tensor(rate).cumprod(0).sum()), tokens=int(tokens[0]))
    return out
