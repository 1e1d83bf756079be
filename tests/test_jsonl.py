"""The JSONL reader and writer: line splitting, BOM, encodings, errors, prompt formats, round trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspec_cli.core.data import load_conversations, load_prompts
from dspec_cli.core.errors import DspecError
from dspec_cli.core.jsonl import dumps_line, read_jsonl, write_jsonl

ROLES = st.sampled_from(["system", "user", "assistant"])
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # any code point UTF-8 can carry
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT}), min_size=1, max_size=5).map(
    lambda ms: [{"role": "user", "content": "q"}, *ms]
)


@settings(max_examples=150, deadline=None)
@given(convs=st.lists(MESSAGES, min_size=1, max_size=4))
def test_conversations_round_trip(tmp_path_factory, convs):
    path = tmp_path_factory.mktemp("rt") / "c.jsonl"
    write_jsonl(path, ({"id": f"c{i}", "conversations": m} for i, m in enumerate(convs)))
    back = load_conversations(path)
    assert [c.messages for c in back] == convs
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) == len(convs)  # also safe for tools that split like str.splitlines


@settings(max_examples=100, deadline=None)
@given(turns=st.lists(TEXT.filter(str.strip), min_size=1, max_size=3))
def test_prompts_round_trip(tmp_path_factory, turns):
    path = tmp_path_factory.mktemp("rt") / "p.jsonl"
    write_jsonl(path, [{"turns": turns}])
    (prompt,) = load_prompts(path)
    assert prompt.turns == tuple(turns)


def test_raw_separators_bom_and_crlf_are_read(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = ['{"turns": ["a\u2028b\u2029c\u0085d"]}', "", '{"turns": ["second"]}']
    path.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == ["a\u2028b\u2029c\u0085d", "second"]


@pytest.mark.parametrize(
    "line",
    [
        {"turns": ["hi", "more"]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}, {"from": "human", "value": "more"}]},
        {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]},
    ],
    ids=["turns", "sharegpt-from-value", "sharegpt-role-content", "messages"],
)
def test_prompt_formats(tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (prompt,) = load_prompts(path)
    assert prompt.text == "hi" and prompt.turns == ("hi", "more")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"turns": ["ok"]}\n{"turns": [\n', "p.jsonl:2: not valid JSON"),
        (b'{"turns": ["ok"]}\n\n["a"]\n', "p.jsonl:3: expected a JSON object"),
        (b'{"turns": ["ok"]}\n{"turns": ["\xff"]}\n', "p.jsonl:2: not valid UTF-8"),
        (b'{"text": "no prompt"}\n', "p.jsonl:1: line has no 'turns', 'conversations' or 'messages'"),
        (b'{"messages": [{"role": "assistant", "content": "x"}]}\n', "p.jsonl:1: 'conversations' has no user turn"),
    ],
)
def test_errors_name_file_and_line(tmp_path, raw, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(raw)
    with pytest.raises(DspecError, match=message):
        load_prompts(path)


def test_writer_escapes_separators_only():
    line = dumps_line({"t": "é\u2028ü"})
    assert line == '{"t": "é\\u2028ü"}\n' and json.loads(line) == {"t": "é\u2028ü"}


def test_folder_is_an_error(tmp_path):
    with pytest.raises(DspecError, match="is a folder"):
        list(read_jsonl(tmp_path, "dataset"))
