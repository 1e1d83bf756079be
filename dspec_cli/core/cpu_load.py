"""How much CPU other processes took while a measurement ran.

A benchmark pairs plain and speculative decoding unit by unit, so a steady competitor for the
CPU slows both alike and leaves the ratio standing; what it does change is every tokens/s
figure (and, on a small machine, the intervals). :class:`CpuMeter` says how many cores other
processes used on average: the machine's busy time (``/proc/stat``: user, nice, system, irq,
softirq, and steal, the time a hypervisor gave other guests) minus this process's own CPU time
(all its threads), over the wall time of the block. Linux only; elsewhere it reports None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CpuMeter", "busy_seconds"]

STAT = Path("/proc/stat")


def busy_seconds(stat: Path = STAT) -> float | None:
    """CPU seconds the whole machine has spent busy since boot (None without ``/proc/stat``)."""
    try:
        first = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process, every thread included."""
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """``with CpuMeter() as m: ...`` then ``m.other_cores``: the average number of cores other
    processes kept busy during the block (None where the machine does not say)."""

    def __init__(self, stat: Path = STAT) -> None:
        self.stat = stat
        self.other_cores: float | None = None

    def __enter__(self) -> CpuMeter:
        self._start = (busy_seconds(self.stat), own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy0, own0, t0 = self._start
        busy1, wall = busy_seconds(self.stat), time.perf_counter() - t0
        if busy0 is None or busy1 is None or wall <= 0:
            return
        other = (busy1 - busy0) - (own_seconds() - own0)
        self.other_cores = max(other, 0.0) / wall
