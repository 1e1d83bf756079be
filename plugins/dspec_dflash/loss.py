"""Position-weighted block losses of DFlash / DSpark (paper eqs. 9-12; DeepSpec ``deepspec/modeling/dspark/loss.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_losses(
    draft_logits: torch.Tensor,  # [M, V] draft logits of the supervised slots (head-corrected)
    target_logits: torch.Tensor,  # [M, V] target logits at the same positions
    labels: torch.Tensor,  # [M] the token each slot predicts
    slots: torch.Tensor,  # [M] slot index k in 0..B−1
    conf_logits: torch.Tensor | None,  # [M] confidence-head logits, or None
    *,
    block_size: int,
    ce_weight: float,
    l1_weight: float,
    conf_weight: float,
    decay_gamma: float,
) -> dict:
    """``ce_weight``·CE + ``l1_weight``·‖p_d − p_t‖₁ + ``conf_weight``·BCE(c_k, 1 − TV_k).

    Every term is Σ_k w_k·term_k / Σ w_k with w_k = exp(−k/γd) (p_d, p_t at T = 1; the BCE label
    is detached). Returns {"loss" (tensor), "ce", "l1", "conf" (0.0 without a head),
    "accept_rate@1" .. "accept_rate@B" (mean 1 − TV of slot k−1, 0.0 where no data),
    "tau_probabilistic" (1 + Σ_k Π_{j≤k} accept_rate@j), "tokens" (supervised slots)}; all
    metrics are plain floats, as the training loop averages scalars.
    """
    w = torch.exp(-slots.float() / decay_gamma)  # [M]
    denom = w.sum().clamp(min=1e-6)
    ce = (w * F.cross_entropy(draft_logits, labels, reduction="none")).sum() / denom
    with torch.set_grad_enabled(torch.is_grad_enabled() and l1_weight > 0):
        p_d = torch.softmax(draft_logits.float(), dim=-1)
        l1_each = (p_d - torch.softmax(target_logits.float(), dim=-1)).abs().sum(-1)  # [M] = 2·TV
    l1 = (w * l1_each).sum() / denom
    accept = (1 - 0.5 * l1_each.detach()).clamp(0, 1)  # [M]
    loss = ce_weight * ce + (l1_weight * l1 if l1_weight > 0 else 0.0)
    conf = torch.zeros((), device=draft_logits.device)
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits, accept, reduction="none")
        conf = (w * bce).sum() / denom
        loss = loss + conf_weight * conf
    counts = torch.bincount(slots, minlength=block_size).clamp(min=1)
    rate = torch.zeros(block_size, device=accept.device).index_add_(0, slots, accept) / counts
    tau = 1 + torch.cumprod(rate, 0).sum()
    out = {"loss": loss, "ce": float(ce.detach()), "l1": float(l1.detach()), "conf": float(conf.detach())}
    out.update({f"accept_rate@{k + 1}": r for k, r in enumerate(rate.tolist())})
    out.update(tau_probabilistic=float(tau), tokens=int(slots.numel()))
    return out
