"""Output paths of the commands: proven writable before any work starts, written atomically.

``-`` means stdout for every output that can stream, and so do ``/dev/stdout`` and
``/dev/fd/1``. A regular file (or a new path) is written to a temporary name in its folder and
renamed into place, so an interruption leaves the old file (or none), never half of a new one,
with the mode a plain new file gets (``0666 & ~umask``). A symbolic link is followed: the file it
points to is written, the link stays. A special file (a character device such as ``/dev/null``, a
FIFO, or a path through a file descriptor: ``/dev/fd/N``, ``/dev/stderr``, a shell's ``>(...)``) is
opened and written through in place: never replaced, never read, never probed by opening it. Any
other kind of file is refused. Folders the command owns whole (``export --output``,
``calibrate --output``) are built beside and swapped in (:func:`replace_folder`).

Comparing the paths of a run with each other (an output that is an input) is
:mod:`dspec_cli.core.run_paths`'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from dspec_cli.core.errors import DspecError

STDOUT = "-"
_FD_LINK = re.compile(r"^/(?:dev|proc/[^/]+)/fd/\d+$|^/dev/std(?:in|out|err)$")
T = TypeVar("T")


def through_descriptor(path: str | Path) -> bool:
    """Whether ``path`` leads (itself, or through symbolic links) to a file descriptor of this
    process: ``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N``, a shell's ``>(...)``."""
    p = os.path.abspath(str(path))
    for _ in range(40):  # the kernel's own limit on links followed
        if _FD_LINK.match(p):
            return True
        try:
            link = os.readlink(p)
        except OSError:
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    return False


def is_stdout(path: str | Path | None) -> bool:
    """``-``, or a descriptor path that is this process's stdout (``/dev/stdout``, ``/dev/fd/1``)."""
    if path is None:
        return False
    if str(path) == STDOUT:
        return True
    if not through_descriptor(path):
        return False
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except OSError:
        return False


def _stat(path: str | Path, option: str) -> os.stat_result | None:
    """``os.stat`` following links; None for a missing path or a dangling link (created by the
    write), an error naming the option for a link loop or an unreadable path."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a file where a folder should be: the folder check names it
    except OSError as exc:
        raise DspecError(f"{option} {path}: {exc.strerror or exc}") from None


def is_special(path: str | Path) -> bool:
    """Written through in place, never replaced: an existing character device or FIFO, or a path
    through a file descriptor."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or (through_descriptor(path) and not stat.S_ISDIR(mode))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISREG, "file")):
        if test(mode):
            return name
    return "special file"


def check_output_file(path: str | Path | None, option: str, *, overwrite: bool = True, stream: bool = True) -> None:
    """Fail now, before any model loads, unless ``path`` can be written: an existing regular file
    (``overwrite=False``: none), a writable special file, stdout (``stream``), or a new file whose
    folder (the nearest existing one, where folders are missing) takes a new file, proven by
    creating and removing one. ``None`` passes."""
    if path is None:
        return
    if is_stdout(path):
        if not stream:
            raise DspecError(f"{option} {path}: this output cannot go to stdout; give a file path")
        return
    if str(path).endswith(("/", os.sep)):
        raise DspecError(f"{option} {path}: ends with '/', which names a folder; give a file path")
    st = _stat(path, option)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise DspecError(f"{option} {path}: is a folder; give a file path")
        if is_special(path):
            if not os.access(path, os.W_OK):
                raise DspecError(f"{option} {path}: not writable")
            return
        if not stat.S_ISREG(st.st_mode):
            raise DspecError(f"{option} {path}: is a {_kind(st.st_mode)}; give a file path")
        if not overwrite:
            raise DspecError(f"{option} {path}: exists; pass --overwrite to replace it")
        if not os.access(path, os.W_OK):
            raise DspecError(f"{option} {path}: not writable")
    _prove_folder(Path(os.path.realpath(path)).parent, option, path)


def check_output_dir(path: str | Path | None, option: str, *, overwrite: bool = True) -> None:
    """Fail now unless folder ``path`` can be created or written into (proven by creating and
    removing a folder in it, or in its nearest existing parent); ``overwrite=False``: a folder
    that holds files is refused too."""
    if path is None:
        return
    if str(path) == STDOUT:
        raise DspecError(f"{option} -: stdout cannot hold a folder; give a folder path")
    st = _stat(path, option)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise DspecError(f"{option} {path}: is a {_kind(st.st_mode)}, not a folder; give a folder path")
    real = Path(os.path.realpath(path))
    if st is not None and not overwrite and any(real.iterdir()):
        raise DspecError(f"{option} {path}: folder is not empty; pass --overwrite to replace what it holds")
    _prove_folder(real if st is not None else real.parent, option, path)


def _prove_folder(folder: Path, option: str, shown) -> None:
    """Create and remove a temporary folder in ``folder``, or in its nearest existing ancestor when
    it is missing (the command creates the missing folders): permission bits alone do not tell
    (root, read-only mounts, /proc)."""
    while not os.path.lexists(folder):
        folder = folder.parent
    if not folder.is_dir():
        raise DspecError(f"{option} {shown}: {folder} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dspec-probe-", dir=folder))
    except OSError as exc:
        raise DspecError(f"{option} {shown}: cannot write in {folder}: {exc.strerror or exc}") from None


def umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ensure_folder(path: str | Path) -> Path:
    """The folder ``path`` with its missing parents created, links followed (a dangling link to a
    folder creates the folder it names); returns the real path."""
    real = Path(os.path.realpath(path))
    real.mkdir(parents=True, exist_ok=True)
    return real


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(p)`` to produce ``path``: for a regular file or a new path ``p`` is a temporary
    name in the same folder, given the mode of a new file and renamed into place afterwards; a
    symbolic link is followed; a special file is written in place (``p`` is ``path``). A failed
    write names the path. Stdout (``-``) is for the text writers (:func:`atomic_write_text`)."""
    if str(path) == STDOUT:
        raise ValueError("write_atomic writes files; stream text with atomic_write_text")
    try:
        if is_special(path):
            write(Path(path))
            return
        target = Path(os.path.realpath(path))
        ensure_folder(target.parent)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            os.chmod(tmp, 0o666 & ~umask())  # mkstemp's (and safetensors') 0600 would differ from every other file
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as :func:`write_atomic` does, or to stdout for ``-``."""
    if is_stdout(path):
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as exc:
            raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None
        return
    write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data: Any) -> str | None:
    """``data`` as indented JSON to ``path`` (atomically) or to stdout. Returns the path written,
    None for stdout (so callers print "wrote PATH" only for files)."""
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return None if is_stdout(path) else str(path)


@contextlib.contextmanager
def open_append(path: str | Path) -> Iterator[IO[str]]:
    """A text file to append lines to: stdout for ``-`` (left open), a special file opened for
    writing in place, a regular file (links followed) opened for appending. Errors name the path."""
    if is_stdout(path):
        yield sys.stdout
        sys.stdout.flush()
        return
    try:
        special = is_special(path)
        real = Path(path) if special else Path(os.path.realpath(path))
        if not special:
            ensure_folder(real.parent)
        f = open(real, "a", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with f:
            yield f
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EPIPE, errno.EIO):
            raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


def replace_folder(path: str | Path, build: Callable[[Path], T]) -> T:
    """Build the folder ``path`` whole: ``build(staging)`` fills a new folder beside it, which then
    takes its place (the old one, if any, is removed after the swap), so the folder holds exactly
    what this run wrote and an interruption leaves the old one (or none). Links are followed."""
    out = Path(os.path.realpath(path))
    ensure_folder(out.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    os.chmod(staging, 0o777 & ~umask())
    old = None
    try:
        result = build(staging)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / "folder")
        try:
            os.replace(staging, out)
        except OSError:
            if old is not None:  # put the old folder back
                os.replace(old / "folder", out)
            raise
        return result
    except OSError as exc:
        raise DspecError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
