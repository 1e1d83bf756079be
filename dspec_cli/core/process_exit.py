"""Ending a process whose native threads must not see the interpreter shut down.

After a ``torch.distributed`` run on the gloo backend, ``destroy_process_group`` does not stop
gloo's worker threads while anything else (FSDP2's device mesh, DTensor's caches) still holds the
group. A worker that releases a finished collective late (a loaded CPU deschedules it between
signalling completion and dropping the work) decrefs Python tensors; during interpreter
finalization that GIL acquire ends the thread inside a ``noexcept`` frame and the process aborts
with "terminate called without an active exception", after every file was written. Such a process
ends through :func:`exit_now` instead: streams and logging flushed, then ``os._exit``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

_reason: str | None = None


def request_exit_without_finalization(reason: str) -> None:
    """Ask the command line to end this process with :func:`exit_now` (first reason wins)."""
    global _reason
    _reason = _reason or reason


def exit_without_finalization_requested() -> str | None:
    """Why the process must skip interpreter finalization, or None."""
    return _reason


def exit_now(code: int) -> NoReturn:
    """Flush what Python buffers, then end the process without interpreter finalization."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    os._exit(code)
