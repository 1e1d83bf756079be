"""Where reading a tensor's value on the host is free.

A CPU tensor lives in host memory: reading a value (``int(t)``, ``.tolist()``, ``bool(t)``)
costs the read and nothing else. On a GPU the same read waits for every queued kernel (a host
synchronisation) and cannot happen inside a captured CUDA graph at all. Code with a cheaper
data-dependent path on a CPU (sizing a loop by the data, stopping a walk early, cutting an
attention window to the exact length) asks :func:`reads_free` first, so the path a GPU runs
never reads. Code being traced by ``torch.compile`` takes the GPU's path on a CPU too (a host
read there would end the graph). :func:`device_path` turns the cheaper paths off: CPU tests then run (and count the
host reads of, :func:`dspec_cli.testing.count_host_reads`) exactly what a GPU runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["device_path", "reads_free"]

_device_path = 0  # > 0 inside device_path()


def reads_free(where: torch.Tensor | torch.device) -> bool:
    """True when reading values of ``where`` (a tensor or a device) on the host needs no device
    synchronisation: a CPU tensor, outside :func:`device_path` and outside ``torch.compile``."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.type == "cpu" and not _device_path and not torch.compiler.is_compiling()


@contextmanager
def device_path() -> Iterator[None]:
    """Run the code paths a GPU runs, on a CPU too (tests; nests)."""
    global _device_path
    _device_path += 1
    try:
        yield
    finally:
        _device_path -= 1
