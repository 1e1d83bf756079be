"""Typed records at the file and option boundaries: JSON text parsed safely, then validated into a
pydantic model, every failure one line naming the file or option and the field.

:func:`parse_json` reads JSON text as the JSON standard has it and nothing more: no ``NaN`` or
``Infinity`` (which Python's :mod:`json` accepts, and which no other JSON reader does), no key twice
in one object (readers disagree on which counts), no number
that overflows to infinity, no integer outside the signed 64-bit range, no string holding a lone
UTF-16 surrogate (``"\\ud800"``: not text, no tokenizer or UTF-8 file takes it) and no nesting
deeper than :data:`MAX_DEPTH` levels. :func:`check_tree` applies the same rules to values that
come from elsewhere (TOML tables, Python objects). :func:`validate` turns a parsed value into a
:class:`Record` (pydantic v2, strict types: no ``"3"`` for 3, no ``true`` for 1, unknown keys
refused unless a record says otherwise).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspec_cli.core.errors import DspecError

MAX_DEPTH = 32  # nesting levels of a JSON value (a chat-template kwargs object, a calibration file)
INT_LIMIT = 2**63  # integers must lie in [-2**63, 2**63)

R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """A typed record read from a file or an option: strict types, finite numbers, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


# limits shared by records and options: beyond them a value is a typo, and would fail only after a
# model has loaded (an allocation, an overflow inside torch)
MAX_CONCURRENCY = 4096  # concurrent requests of one engine
MAX_TOKENS = 2**24  # tokens: --max-new-tokens, token-batch sizes, contexts
MAX_BLOCK = 1024  # γ, draft tokens per round

# field types shared by the records
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Count = Annotated[int, Field(ge=0, lt=2**31)]
PositiveInt = Annotated[int, Field(ge=1, lt=2**31)]


class _Constant(ValueError):
    pass


class _Duplicate(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def parse_json(text: str, where: str, *, one_line: bool = False) -> Any:
    """The JSON value of ``text``; a DspecError starting with ``where`` (the option or file) that
    names the line (``one_line``: the column), or the field, of the first problem."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique)
    except _Constant as exc:
        raise DspecError(f"{where}: {exc} is not a JSON number (NaN and infinities are not JSON)") from None
    except _Duplicate as exc:
        raise DspecError(f"{where}: key {str(exc)!r} appears twice in one object (which one counts is not defined)") from None
    except json.JSONDecodeError as exc:
        at = f"column {exc.colno}" if one_line else f"line {exc.lineno}"
        raise DspecError(f"{where}: not valid JSON ({exc.msg}, {at})") from None
    except RecursionError:
        raise DspecError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # an integer of more digits than Python converts
        raise DspecError(f"{where}: holds a number of more digits than any JSON reader takes") from None
    check_tree(value, where)
    return value


def check_tree(value: Any, where: str) -> None:
    """DspecError unless ``value`` is plain JSON data within the rules above (see module docstring)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()  # depth: the objects and lists around this node
        if isinstance(node, dict | list | tuple) and depth >= MAX_DEPTH:
            raise DspecError(f"{where}: nested deeper than {MAX_DEPTH} levels (at {path})")
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str):
                    raise DspecError(f"{where}: {path or 'the object'} has a key that is not a string ({key!r})")
                _check_text(key, where, f"{path}.{key}" if path else key)
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(node, list | tuple):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node))
        elif isinstance(node, str):
            _check_text(node, where, path)
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            if not -INT_LIMIT <= node < INT_LIMIT:
                raise DspecError(f"{where}: {_at(path)}integer {_short(node)} is out of range (64-bit integers only)")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise DspecError(f"{where}: {_at(path)}{node!r} is not a finite number")
        else:
            raise DspecError(f"{where}: {_at(path)}a {type(node).__name__} is not a JSON value")


def _check_text(text: str, where: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(exc.object[exc.start])
        at = f" at {path}" if path else ""
        raise DspecError(f"{where}: holds a lone surrogate \\u{code:04x}{at}, which is not text (no tokenizer "
                         "encodes it)") from None


def _at(path: str) -> str:
    return f"{path}: " if path else ""


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_path(loc: Sequence[Any]) -> str:
    """pydantic's error location as ``a.b[0].c`` (a bad key of an object: the key's path)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]" and not str(part).startswith(("function-", "tagged-union", "json-or-python")):
            out += f".{part}" if out else str(part)
    return out


def first_error(exc: ValidationError) -> tuple[str, str]:
    """The first problem of a pydantic error: (field path, what is wrong, with the value given)."""
    err = exc.errors(include_url=False)[0]
    path = field_path(err["loc"])
    kind = err["type"]
    if kind == "missing":
        return path, "missing"
    if kind == "extra_forbidden":
        return path, "unknown key"
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    msg = (msg[:1].lower() + msg[1:]).replace("a valid dictionary", "an object").replace("input should be", "should be")
    got = "" if kind.startswith("value_error") else f" (got {_short(err.get('input'))})"
    return path, msg + got


def describe_error(exc: ValidationError) -> str:
    """The first problem of a pydantic error as ``field: what is wrong (got VALUE)``."""
    path, text = first_error(exc)
    return f"{path}: {text}" if path else text


def validate(model: type[R], data: Any, where: str) -> R:
    """``data`` as a ``model`` record; DspecError ``where: field: problem`` otherwise."""
    if not isinstance(data, dict):
        raise DspecError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise DspecError(f"{where}: {describe_error(exc)}") from None
