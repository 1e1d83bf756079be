"""Output paths of the commands: proven writable before any work starts, written atomically.

``-`` as a ``--json`` path means stdout. A regular file (or a new path) is written to a temporary
name in its folder and renamed into place, so an interruption leaves the old file (or none), never
half of a new one. A symbolic link is followed: the file it points to is written, the link stays.
A character device or a FIFO (``/dev/null``, ``/dev/stdout``, a shell's ``>(...)``) is written
through in place, never replaced by a regular file; any other kind of file is refused.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspec_cli.core.errors import DspecError

STDOUT = "-"


def is_stdout(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def _followed(path: Path) -> Path:
    """``path`` with symbolic links resolved (a dangling link names the file it would create)."""
    return path.resolve() if path.is_symlink() else path


def _written_through(path: Path) -> bool:
    """True for an existing character device or FIFO: written in place, never replaced."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def check_output_file(path: str | Path | None, option: str, *, overwrite: bool = True) -> None:
    """Fail now, before any model loads, unless ``path`` can be written: an existing regular file
    (``overwrite=False``: none), a character device or FIFO that is writable, or a new file whose
    folder (the nearest existing one, where folders are missing) takes a new file, proven by
    creating and removing one. ``None`` and ``-`` pass."""
    if path is None or is_stdout(path):
        return
    p = _followed(Path(path))
    if p.is_dir():
        raise DspecError(f"{option} {path}: is a folder; give a file path")
    if p.exists():
        if not overwrite:
            raise DspecError(f"{option} {path}: exists; pass --overwrite to replace it")
        mode = p.stat().st_mode
        if not (stat.S_ISREG(mode) or _written_through(p)):
            raise DspecError(f"{option} {path}: is a {_kind(mode)}; give a file path")
        if not os.access(p, os.W_OK):
            raise DspecError(f"{option} {path}: not writable")
        if _written_through(p):
            return
    _prove_folder(p.absolute().parent, option, path)


def check_output_dir(path: str | Path | None, option: str, *, overwrite: bool = True) -> None:
    """Fail now unless folder ``path`` can be created or written into (proven by creating and
    removing a folder in it, or in its nearest existing parent); ``overwrite=False``: a folder
    that holds files is refused too."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DspecError(f"{option} {path}: is a file; give a folder")
    if p.is_dir() and not overwrite and any(p.iterdir()):
        raise DspecError(f"{option} {path}: folder is not empty; pass --overwrite to replace what it holds")
    _prove_folder(p.absolute() if p.is_dir() else p.absolute().parent, option, path)


def _prove_folder(folder: Path, option: str, shown) -> None:
    """Create and remove a temporary folder in ``folder``, or in its nearest existing ancestor when
    it is missing (the command creates the missing folders): permission bits alone do not tell
    (root, read-only mounts, /proc)."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise DspecError(f"{option} {shown}: {folder} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dspec-probe-", dir=folder))
    except OSError as exc:
        raise DspecError(f"{option} {shown}: cannot write in {folder}: {exc.strerror or exc}") from None


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(p)`` to produce ``path``: for a regular file or a new path ``p`` is a temporary
    name in the same folder, renamed into place afterwards; a symbolic link is followed; a
    character device or FIFO is written in place. A failed write names the path."""
    target = _followed(Path(path))
    try:
        if _written_through(target):
            write(target)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as :func:`write_atomic` does."""
    write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data: Any) -> str | None:
    """``data`` as indented JSON to ``path`` (atomically) or to stdout for ``-``. Returns the path
    written, None for stdout (so callers print "wrote PATH" only for files)."""
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    if is_stdout(path):
        sys.stdout.write(text)
        sys.stdout.flush()
        return None
    atomic_write_text(path, text)
    return str(path)
