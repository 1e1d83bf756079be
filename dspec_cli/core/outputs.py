"""Output paths of the commands: checked before any work starts, written atomically.

``-`` as a ``--json`` path means stdout. A file is written to a temporary name in its folder and
renamed into place, so an interruption leaves the old file (or none), never half of a new one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from dspec_cli.core.errors import DspecError

STDOUT = "-"


def is_stdout(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def check_output_file(path: str | Path | None, option: str, *, overwrite: bool = True) -> None:
    """Fail now, before any model loads, if ``path`` cannot be written: it is a folder, its parent
    is a file or not writable, or (``overwrite=False``) it exists. ``None`` and ``-`` pass."""
    if path is None or is_stdout(path):
        return
    p = Path(path)
    if p.is_dir():
        raise DspecError(f"{option} {path}: is a folder; give a file path")
    if p.exists() and not overwrite:
        raise DspecError(f"{option} {path}: exists; pass --overwrite to replace it")
    if p.exists() and not os.access(p, os.W_OK):
        raise DspecError(f"{option} {path}: not writable")
    _check_parent(p, option, path)


def check_output_dir(path: str | Path | None, option: str) -> None:
    """Fail now if folder ``path`` cannot be created or written into."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DspecError(f"{option} {path}: is a file; give a folder")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise DspecError(f"{option} {path}: folder is not writable")
        return
    _check_parent(p, option, path)


def _check_parent(p: Path, option: str, shown) -> None:
    """The nearest existing ancestor of ``p`` must be a writable folder (missing folders are created)."""
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DspecError(f"{option} {shown}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DspecError(f"{option} {shown}: folder {parent} is not writable")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
