"""The one JSONL reader and writer of every command.

Reading: lines end at ``"\\n"`` only (a ``"\\r"`` before it is dropped), so U+2028, U+2029, U+0085
and other characters :meth:`str.splitlines` breaks on stay inside their JSON strings; a UTF-8
BOM is tolerated; blank lines are skipped; invalid UTF-8, invalid JSON, a non-object line or a
string escaping a lone UTF-16 surrogate is an error naming ``file:line``.

Writing: one object per line, non-ASCII text kept as UTF-8, and the separators U+0085, U+2028
and U+2029 written as ``\\u`` escapes (still the same JSON; control characters are escaped by
:mod:`json` anyway), so line-oriented tools that split on them read the files too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import read_bytes
from dspec_cli.core.outputs import atomic_write_text
from dspec_cli.core.records import parse_json

_BOM = "\ufeff"
_SEPARATORS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"})


def dumps_line(obj: Any) -> str:
    """``obj`` as one JSON line, newline included."""
    return json.dumps(obj, ensure_ascii=False).translate(_SEPARATORS) + "\n"


def write_line(f: IO[str], obj: Any) -> None:
    """Append ``obj`` as one line to a text file opened with ``encoding="utf-8"``."""
    f.write(dumps_line(obj))


def write_jsonl(path: str | Path, objects: Iterable[Any]) -> None:
    """Write ``objects`` to ``path`` atomically (a temporary file renamed into place)."""
    atomic_write_text(Path(path), "".join(dumps_line(o) for o in objects))


def split_lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for ``text`` split on ``"\\n"`` only; a BOM and ``"\\r"`` dropped."""
    text = text.removeprefix(_BOM)
    for lineno, line in enumerate(text.split("\n"), 1):
        yield lineno, line.removesuffix("\r")


def parse_lines(text: str, name: str) -> Iterator[tuple[str, dict]]:
    """(``name:line``, object) per non-blank line of ``text``, each line read by
    :func:`~dspec_cli.core.records.parse_json` (no NaN, no lone surrogate, bounded depth)."""
    for lineno, line in split_lines(text):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        obj = parse_json(line, where, one_line=True)
        if not isinstance(obj, dict):
            raise DspecError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def decode(raw: bytes, name: str) -> str:
    """UTF-8 text of a file's bytes; invalid bytes are an error naming the line they are on."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DspecError(f"{name}:{line}: not valid UTF-8 (byte {raw[exc.start]:#04x})") from None


def read_jsonl(path: str | Path, kind: str = "file") -> Iterator[tuple[str, dict]]:
    """(``file:line``, object) per non-blank line of the file at ``path``."""
    yield from parse_lines(decode(read_bytes(path, kind, "jsonl file"), str(path)), str(path))
