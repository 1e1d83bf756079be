"""Advisory locks on what a run writes: a second dspec run that would write the same file or
folder while the first still runs is refused at once, in one line naming the first (its process
id and command line), before it loads anything.

The locks are ``filelock`` locks (``flock`` on Unix), one per output, keyed by the output's real
path and kept in a per-user folder (``DSPEC_LOCK_DIR``, else ``$XDG_CACHE_HOME/dspec/locks``,
else ``~/.cache/dspec/locks``), so nothing is left beside the user's files; the operating system
releases them when a process ends, however it ends. Locks are advisory: they keep dspec runs
apart, not other programs. Under ``torchrun`` rank 0 holds them for the whole group.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from dspec_cli.core.errors import DspecError

_held: list[FileLock] = []


def lock_dir() -> Path | None:
    """The folder the lock files live in, created on first use; None where none can be made."""
    env = os.environ.get("DSPEC_LOCK_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    fallback = os.path.join(tempfile.gettempdir(), f"dspec-locks-{os.getuid() if hasattr(os, 'getuid') else 0}")
    for folder in ([env] if env else [os.path.join(cache, "dspec", "locks"), fallback]):
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                return Path(folder)
        except OSError:
            continue
    return None


def hold(real: str, option: str, shown: str | Path) -> FileLock | None:
    """Lock the output known as ``real`` (its real path, or its inode) (``option`` ``shown``: as the user typed it) until
    :func:`release` (or :func:`release_all`); DspecError naming the other run when one holds it.
    None where no lock is taken (a rank other than 0, no lock folder)."""
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 holds the group's locks
        return None
    folder = lock_dir()
    if folder is None:
        return None
    key = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    lock = FileLock(str(folder / f"{key}.lock"), timeout=0, thread_local=False)
    owner = folder / f"{key}.json"
    try:
        lock.acquire()
    except Timeout:
        raise DspecError(f"{option} {shown}: another dspec run is writing it ({_describe(owner)}); wait for it "
                         "to finish or give another path") from None
    except OSError:
        return None  # a lock folder that takes no locks (some network file systems): run unlocked
    _held.append(lock)
    try:
        owner.write_text(json.dumps({"pid": os.getpid(), "command": _command(), "path": real}), encoding="utf-8")
    except OSError:
        pass
    return lock


def release(lock: FileLock | None) -> None:
    """Release one lock :func:`hold` took (None: nothing)."""
    if lock is not None and lock in _held:
        _held.remove(lock)
        lock.release()


def release_all() -> None:
    """Release every lock this process holds (the end of a command)."""
    while _held:
        _held.pop().release()


def _command() -> str:
    args = [os.path.basename(sys.argv[0]) if sys.argv else "dspec", *sys.argv[1:]]
    if args[0] in ("__main__.py", "-m"):
        args[0] = "dspec"
    return " ".join(args)


def _describe(owner: Path) -> str:
    try:
        info = json.loads(owner.read_text(encoding="utf-8"))
        return f"pid {int(info['pid'])}: {str(info['command'])[:120]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its process id is not recorded"
