"""Safe JSON and typed records (core/records.py): JSON as the standard has it, strict types, and
one-line errors naming the file or option and the field."""

from __future__ import annotations

import inspect
import re

import pytest

from dspec_cli.core.chat_template import RESERVED
from dspec_cli.core.errors import DspecError
from dspec_cli.core.records import Record, check_tree, parse_json, validate


@pytest.mark.parametrize(("text", "message"), [
    ('{"a": NaN}', "x: NaN is not a JSON number"),
    ('[-Infinity]', "x: -Infinity is not a JSON number"),
    ('{"a": 1e999}', "x: a: inf is not a finite number"),
    ('{"a": [1, 9223372036854775808]}', "x: a[1]: integer 9223372036854775808 is out of range"),
    ('{"a": -9223372036854775809}', "out of range"),
    ('{"a": "\\ud800"}', "x: holds a lone surrogate \\ud800 at a"),
    ('{"\\udc00": 1}', "holds a lone surrogate \\udc00"),
    ('{"a": 1, "a": 2}', "x: key 'a' appears twice"),
    ("[" * 33 + "]" * 33, "x: nested deeper than 32 levels"),
    ("[" * 100000 + "]" * 100000, "x: nested deeper than 32 levels"),
    ("1" * 5000, "more digits than any JSON reader takes"),
    ('{"a": ', "x: not valid JSON (Expecting value, line 1)"),
])
def test_parse_json_refuses_what_json_does_not_have(text, message):
    with pytest.raises(DspecError, match=re.escape(message)):
        parse_json(text, "x")


def test_parse_json_keeps_plain_json():
    value = {"a": [1, -2, 3.5, True, None, "é\u2028"], "b": {"c": [[1]] * 3}, "d": 9223372036854775807}
    import json

    assert parse_json(json.dumps(value), "x") == value
    assert parse_json("[" * 32 + "]" * 32, "x") is not None


def test_check_tree_takes_only_json_values():
    import datetime

    for bad, message in [({"d": datetime.date(2024, 1, 1)}, "d: a date is not a JSON value"),
                         ({1: "a"}, "has a key that is not a string"), ({"f": float("nan")}, "f: nan is not a finite")]:
        with pytest.raises(DspecError, match=message):
            check_tree(bad, "t")
    check_tree({"a": (1, 2), "b": [{"c": None}]}, "t")


class _Point(Record):
    x: int
    y: float = 0.0
    tags: list[str] = []


@pytest.mark.parametrize(("data", "message"), [
    ({}, "p: x: missing"),
    ({"x": "3"}, "p: x: should be a valid integer (got '3')"),
    ({"x": True}, "p: x: should be a valid integer (got True)"),
    ({"x": 1, "z": 2}, "p: z: unknown key"),
    ({"x": 1, "y": float("inf")}, "p: y: should be a finite number"),
    ({"x": 1, "tags": ["a", 2]}, "p: tags[1]: should be a valid string"),
    ([1], "p: expected a JSON object, got list"),
])
def test_validate_names_the_field(data, message):
    with pytest.raises(DspecError, match=re.escape(message)):
        validate(_Point, data, "p")
    assert validate(_Point, {"x": 1, "y": 2}, "p") == _Point(x=1, y=2.0)


def test_reserved_template_names_cover_what_transformers_sets():
    """Every named parameter of ``apply_chat_template`` (and the ``messages`` the renderer passes)
    is refused as a chat-template kwarg: given twice, it ends in a TypeError or is silently lost."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
    assert named | {"messages"} <= RESERVED
