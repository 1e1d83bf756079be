"""``train.shard = "fsdp"``: the drafter sharded with torch's FSDP2 (``fully_shard``).

For drafters whose weights plus optimizer state do not fit one device. Every ``nn.ModuleList``
entry of the net (its decoder layers) is one FSDP unit, the rest of the net the root unit; the
step loop is the DDP one (``set_requires_gradient_sync(False)`` plays ``no_sync``). Checkpoints
hold full, unsharded tensors, gathered to rank 0 (the same files as an unsharded run, except that
``optimizer.pt`` keys its state by parameter name); resuming scatters them back, so a resumed run
equals an uninterrupted one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dspec_cli.core.errors import DspecError

_PREFIX = "net."  # the loss module's name for drafter.net


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def shard(module: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` every ModuleList entry of ``module``, then ``module`` itself."""
    from torch.distributed.fsdp import fully_shard

    for sub in list(module.modules()):
        if isinstance(sub, torch.nn.ModuleList):
            for layer in sub:
                fully_shard(layer)
    fully_shard(module)
    return module


@contextlib.contextmanager
def gathered(module: torch.nn.Module, drafter, optimizer, main: bool) -> Iterator[None]:
    """Inside, ``drafter.net.state_dict()`` and ``optimizer.state_dict()`` return full tensors on
    rank 0 (``main``), so the ordinary save code writes them. Collective: every rank enters."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    weights = get_model_state_dict(module, options=_options(cpu_offload=True))
    optim = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    if not main:
        yield
        return
    weights = {k.removeprefix(_PREFIX): v for k, v in weights.items()}
    drafter.net.state_dict = lambda *a, **k: weights
    optimizer.state_dict = lambda: optim
    try:
        yield
    finally:
        del drafter.net.state_dict, optimizer.state_dict


def load(path: Path, module: torch.nn.Module, optimizer, scheduler) -> list[dict]:
    """Restore a checkpoint written through :func:`gathered`; returns the per-rank RNG states."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    try:
        weights: dict[str, Any] = {_PREFIX + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
        set_model_state_dict(module, weights, options=_options())
        optim = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        set_optimizer_state_dict(module, optimizer, optim, options=_options())
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        return torch.load(path / "rng_state.pt", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DspecError(f"checkpoint {path}: cannot restore sharded training state ({detail})") from None


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a plain tensor (clip_grad_norm_ of sharded grads returns a DTensor)."""
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor's
    return full_tensor() if full_tensor is not None else norm
