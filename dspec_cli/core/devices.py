"""``--device`` and ``--dtype`` values: ``auto`` resolved, impossible requests refused in one line."""

from __future__ import annotations

import torch

from dspec_cli.core import hardware
from dspec_cli.core.errors import DspecError

DEVICES = "auto, cpu, cuda or cuda:N"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu; a device this machine lacks is an error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DspecError(f"--device {device!r}: unknown device; use {DEVICES}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise DspecError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DspecError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise DspecError(f"--device {device!r}: unsupported; use {DEVICES}")
    return dev


def parse_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """``auto`` or a floating torch dtype by name (float32, bfloat16, float16)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise DspecError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return value


def auto_dtype(device: torch.device) -> torch.dtype | None:
    """What ``--dtype auto`` means on ``device``: bfloat16 on a GPU that supports it and on a CPU
    that multiplies bfloat16 natively (AVX512-BF16 or AMX), float32 on other CPUs (there the
    bfloat16 fallback is two orders of magnitude slower), None (the checkpoint's own dtype)
    elsewhere. In half precision a token's logits depend slightly on how many tokens share its
    forward, on a CPU as on a GPU (docs/verification.md, "Precision")."""
    if device.type == "cpu":
        return torch.bfloat16 if hardware.cpu_native_half(torch.bfloat16) else torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None
