"""The one output rule of every command: before any work, the paths a run reads and writes are
compared with each other, each output is proven writable and locked.

A command declares its paths (:class:`RunPaths`): the files and folders it reads (a folder may name
the files of it that are read, e.g. a checkpoint's weights and config, so a new report beside them
is fine) and the files and folders it writes (a folder either belongs to the run whole, such as
``export --output``, or names the files written in it, such as ``--plots``). :meth:`RunPaths.check`
then refuses, in one line with exit status 2, an output that is an input (the same file by inode,
or by real path with every symbolic link followed, so a dangling link too), an output inside an
input folder where the run reads, an output folder holding an input, and two outputs that are the
same file or one inside a folder that belongs to the other. ``-`` (and ``/dev/stdout``) is stdout,
so two streamed outputs clash too; ``/dev/null`` takes any number of outputs. Each output then goes
through :func:`~dspec_cli.core.outputs.check_output_file` / ``check_output_dir`` and is locked
(:mod:`dspec_cli.core.locks`) until the command ends.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dspec_cli.core import locks
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import DEFAULT_TARGET_PATH, embedded_path
from dspec_cli.core.outputs import (
    check_output_dir,
    check_output_file,
    is_special,
    is_stdout,
)

BUILTIN_PROMPTS = embedded_path("prompts.jsonl")


class PathConflict(DspecError):
    """Two paths of one run that must differ do not: a usage error."""

    exit_code = 2


@dataclass(frozen=True)
class _Path:
    option: str
    shown: str  # as the user typed it
    output: bool
    folder: bool
    names: tuple[str, ...] | None  # input folder: the names read in it; output folder: the files written in it
    stream: bool = False
    overwrite: bool = True
    real: str = ""  # every link followed ("<stdout>" for stdout)
    key: tuple | None = None  # (device, inode) of what exists there
    hint: str = ""  # said when an output is this very input


def _place(path: str) -> tuple[str, tuple | None]:
    """(real path, (device, inode) or None) of ``path``; stdout is ``<stdout>``."""
    if is_stdout(path):
        try:
            st = os.fstat(1)
            return "<stdout>", (st.st_dev, st.st_ino)
        except OSError:
            return "<stdout>", ("stdout",)
    try:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
    except OSError:
        key = None
    return os.path.realpath(path), key


_DEVNULL = _place(os.devnull)[1] if os.path.exists(os.devnull) else None


class RunPaths:
    """The paths one run reads and writes (declared by its command), checked together by :meth:`check`."""

    def __init__(self) -> None:
        self._paths: list[_Path] = []
        self._locks: list = []
        # what any run may read without naming it (writing into the rest of the package, e.g. calibrating
        # an embedded drafter --in-place, is a maintainer's step)
        self.read("the embedded target", DEFAULT_TARGET_PATH).read("the built-in prompts", BUILTIN_PROMPTS)

    def read(self, option: str, *paths: str | Path | None, names: Sequence[str] | None = None,
             hint: str = "") -> RunPaths:
        """Files or folders the run reads. ``names``: for a folder, the names in it the run reads
        (glob patterns; default: all of it); ``hint``: what to say when an output is this very
        input. Paths that are not there (a Hub id, ``builtin``, a missing file the command will
        report) are left out."""
        for p in paths:
            if p is None or str(p) in ("", "-") or not os.path.lexists(p):
                continue
            real, key = _place(str(p))
            folder = os.path.isdir(p)
            self._paths.append(_Path(option, str(p), False, folder, tuple(names) if names and folder else None,
                                     real=real, key=key, hint=hint))
        return self

    def write(self, option: str, path: str | Path | None, *, stream: bool = False, overwrite: bool = True) -> RunPaths:
        """A file the run writes (``stream``: ``-`` is stdout)."""
        if path is not None:
            real, key = _place(str(path))
            self._paths.append(_Path(option, str(path), True, False, None, stream, overwrite, real, key))
        return self

    def write_folder(self, option: str, path: str | Path | None, *, files: Sequence[str] | None = None,
                     overwrite: bool = True) -> RunPaths:
        """A folder the run writes: whole (``files`` None: replaced or filled by the run), or only the
        named ``files`` in it. ``overwrite=False``: a folder holding files is refused."""
        if path is not None:
            real, key = _place(str(path))
            self._paths.append(_Path(option, str(path), True, True, None if files is None else tuple(files),
                                     False, overwrite, real, key))
        return self

    # -- the rule ------------------------------------------------------------------------------------
    def check(self) -> RunPaths:
        """Refuse conflicting paths (exit 2), prove every output writable, lock the outputs (until
        :meth:`release`, or the end of the command)."""
        outputs = [p for p in self._paths if p.output]
        inputs = [p for p in self._paths if not p.output]
        live = [out for out in outputs if not _sink(out)]
        for i, out in enumerate(live):  # the paths against each other first: the most basic mistake
            for inp in inputs:
                _against_input(out, inp)
            for other in live[i + 1:]:
                _against_output(out, other)
        for out in outputs:  # then each on its own
            if out.folder:
                check_output_dir(out.shown, out.option, overwrite=out.overwrite)
                for name in out.names or ():  # the files it will write there must be files too
                    if "*" not in name:
                        check_output_file(os.path.join(out.shown, name), out.option)
            else:
                check_output_file(out.shown, out.option, overwrite=out.overwrite, stream=out.stream)
        for out in sorted(live, key=lambda p: p.real):
            if out.real != "<stdout>" and (out.folder or not is_special(out.shown)):
                # by real path, and by inode where it exists (a hard link is the same file)
                for key in (out.real, *([f"inode {out.key[0]}:{out.key[1]}"] if out.key else [])):
                    self._locks.append(locks.hold(key, out.option, out.shown))
        return self

    def release(self) -> None:
        """Release the locks :meth:`check` took."""
        while self._locks:
            locks.release(self._locks.pop())


def _sink(p: _Path) -> bool:
    return p.key is not None and p.key == _DEVNULL


def _same(a: _Path, b: _Path) -> bool:
    return (a.key is not None and a.key == b.key) or a.real == b.real


def _inside(child: _Path, folder: _Path) -> str | None:
    """The first name under ``folder`` on the way to ``child`` when ``child`` lies inside it and
    ``folder`` reads or writes that name (all of them unless it names some)."""
    if not folder.folder or "<stdout>" in (folder.real, child.real):
        return None
    root = folder.real.rstrip(os.sep) + os.sep
    if not child.real.startswith(root):
        return None
    name = child.real[len(root):].split(os.sep)[0]
    return name if _matches(name, folder.names) else None


def _matches(name: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _overlap(a: _Path, b: _Path) -> bool:
    """Two folders at one place touch the same files: one is whole, or a name one writes (a
    pattern read as an example name) is one the other reads or writes."""
    if a.names is None or b.names is None:
        return True
    return any(_matches(n.replace("*", "0"), b.names) for n in a.names) or any(
        _matches(n.replace("*", "0"), a.names) for n in b.names)


def _what(p: _Path) -> str:
    return f"{p.option} {p.shown}"


def _against_input(out: _Path, inp: _Path) -> None:
    if _same(out, inp) and (not (out.folder and inp.folder) or _overlap(out, inp)):
        raise PathConflict(f"{_what(out)}: is {_what(inp)}, which this run reads; {inp.hint or 'give another path'}")
    name = _inside(out, inp)
    if name is not None:
        where = "is inside" if inp.names is None else f"is {name} of"
        raise PathConflict(f"{_what(out)}: {where} {_what(inp)}, which this run reads; give another path")
    name = _inside(inp, out)
    if name is not None:
        what = "this run writes the folder whole" if out.names is None else f"this run writes {name} in it"
        raise PathConflict(f"{_what(out)}: holds {_what(inp)}, which this run reads, and {what}; give another "
                           "folder")


def _against_output(a: _Path, b: _Path) -> None:
    if _same(a, b) and (not (a.folder and b.folder) or _overlap(a, b)):
        if a.real == "<stdout>":
            raise PathConflict(f"{_what(a)} and {_what(b)} both write to stdout; give one of them a file path")
        raise PathConflict(f"{_what(a)} and {_what(b)} are the same {'folder' if a.folder else 'file'}; give each "
                           "its own path")
    for outer, inner in ((a, b), (b, a)):
        name = _inside(inner, outer)
        if name is not None:
            what = "which this run writes whole" if outer.names is None else f"whose {name} this run also writes"
            raise PathConflict(f"{_what(inner)}: is inside {_what(outer)}, {what}; give another path")
