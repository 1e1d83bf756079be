"""Linear layers for drafters that decode fast on a CPU.

A float32 or bfloat16 ``F.linear`` on a CPU re-lays its weight out for the matmul library on
every call; for the few rows a drafter computes per round that costs more than the product:
on an AMD EPYC with AVX512-BF16, [7, 256] x [256, 8192] took 152 µs in bfloat16 and 542 µs in
float32 (MKL's small-M path) against 78 µs and 137 µs with the weight packed once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``, the layout PyTorch's own CPU compiler freezes
weights into). :class:`PackedWeight` keeps that packed copy and uses it outside autograd on a CPU;
the result is the same computation (bit-identical in bfloat16 in our checks). Training, other
devices and builds without oneDNN take ``F.linear``. The copy is rebuilt when the weight
changes (its version counter or storage), so fine-tuning and loading weights stay correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "PackedWeight", "onednn_ops"]

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_ops():
    """PyTorch's private oneDNN linear ops, ``torch.ops.mkldnn._reorder_linear_weight`` (pack a
    weight) and ``_linear_pointwise`` (multiply by it): the one place they are read. None where this
    build lacks them (then :class:`PackedWeight` takes ``F.linear``; tests/test_private_apis.py
    fails if an upgrade removes them from a oneDNN build)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except AttributeError:
        return None


_ONEDNN = onednn_ops()


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Eager CPU inference (under torch.compile the compiler packs weights itself)."""
    return (
        not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        and x.device.type == "cpu" and weight.device.type == "cpu"
        and x.dtype == weight.dtype and weight.dtype in _DTYPES
    )  # fmt: skip


class PackedWeight:
    """The oneDNN-packed copy of one weight [out, in] (see the module docstring)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def __getstate__(self) -> dict:  # copies and pickles start unpacked (a packed tensor is a cache)
        return {"_key": None, "_packed": None}

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: x [..., in] -> [..., out]."""
        if _ONEDNN is None or not _packable(x, weight) or (bias is not None and bias.dtype != x.dtype):
            return F.linear(x, weight, bias)
        reorder, linear_pointwise = _ONEDNN
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if key != self._key:
            self._packed = reorder(weight.detach(), None)
            self._key = key
        return linear_pointwise(x, self._packed, bias, "none", [None], "")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) whose CPU inference uses
    :class:`PackedWeight`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pack = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._pack.linear(x, self.weight, self.bias)
