"""Counting host reads: what would make a GPU wait for its host, counted on any device.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, a
data-dependent output shape such as ``nonzero`` or boolean indexing) waits for every queued
kernel, and copying host data to the device (``torch.tensor([...], device=...)``) is a
synchronous copy too; neither may happen inside a captured CUDA graph. :func:`count_host_reads`
counts them as they are called, whatever the device, with the code paths a GPU takes
(:func:`dspec_cli.core.host.device_path`), so a CPU test can assert how many a round makes.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from dspec_cli.core.host import device_path

__all__ = ["HostReads", "count_host_reads"]

# Tensor methods and torch functions that read device values on the host or size their output by them
_READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "equal",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "allclose",
}  # fmt: skip
_FROM_HOST = {"tensor", "as_tensor", "new_tensor"}  # host data copied to the device
_TORCH_DIR = str(Path(torch.__file__).parent)


class HostReads(TorchFunctionMode):
    """A torch function mode counting host reads and host-to-device copies: ``total`` and
    ``sites`` (a Counter of "file:line name" of the first caller outside torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_read(name, args, kwargs):
            self.total += 1
            self.sites[f"{_caller()} {name}"] += 1
        return func(*args, **kwargs)


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _READS:
        return True
    if name in _FROM_HOST:
        data = args[1] if name == "new_tensor" else (args[0] if args else kwargs.get("data"))
        return not isinstance(data, torch.Tensor)
    if name == "to":  # to a device named "cpu" (a tensor's own device is no copy; a CPU run cannot tell)
        return any(isinstance(a, str) and a.startswith("cpu") for a in (*args[1:], kwargs.get("device")))
    if name == "where":
        return len(args) + len(kwargs) == 1  # torch.where(cond): nonzero
    if name == "repeat_interleave":
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and kwargs.get(
            "output_size") is None  # fmt: skip
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and not frame.filename.endswith("host_reads.py"):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads and host-to-device copies made inside, on the code paths a GPU runs."""
    with device_path(), HostReads() as reads:
        yield reads
