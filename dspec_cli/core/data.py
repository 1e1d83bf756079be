"""Prompt sets and conversations: jsonl files of ``{"turns": [...]}``, ShareGPT
``{"conversations": [{"from", "value"} | {"role", "content"}, ...]}`` or OpenAI-style
``{"messages": [{"role", "content"}, ...]}`` lines. Conversations written by ``dspec data
regenerate`` also record the ``chat_template_kwargs`` they were rendered with."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspec_cli.core.chat_template import check_kwargs
from dspec_cli.core.datasets import is_registered, resolve
from dspec_cli.core.errors import DspecError
from dspec_cli.core.jsonl import parse_lines, read_jsonl

BUILTIN = "builtin"  # name of the project's own prompt set (dspec_cli/assets/prompts.jsonl)


@dataclass
class Prompt:
    text: str  # the first user turn
    domain: str = ""
    turns: tuple[str, ...] = ()
    where: str = ""  # file:line it came from


def _first_user_turn(obj: dict, where: str) -> tuple[str, tuple[str, ...]]:
    """The first user turn and every user turn of a ``turns``, ShareGPT or ``messages`` line."""
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DspecError(f"{where}: 'turns' must be a non-empty list of strings")
        return turns[0], tuple(turns)
    users = tuple(m["content"] for m in _messages(obj, where) if m["role"] == "user")
    return users[0], users


def jsonl_objects(path: str | Path, kind: str = "dataset") -> Iterator[tuple[str, dict]]:
    """(``file:line``, object) per non-blank line (:mod:`dspec_cli.core.jsonl`); ``builtin`` is the
    project's own prompt set."""
    if str(path) == BUILTIN:
        text = resources.files("dspec_cli").joinpath("assets/prompts.jsonl").read_text(encoding="utf-8")
        return parse_lines(text, "builtin prompts")
    p = Path(path)
    if not p.exists() and is_registered(str(path)):
        p = resolve(str(path))  # a set that `dspec datasets` lists -> its formatted local copy
    elif not p.exists():
        raise DspecError(f"{kind} {path}: file not found (nor a set that `dspec datasets` lists)")
    return read_jsonl(p, kind)


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file; a malformed line is an error naming file and line (never skipped)."""
    prompts: list[Prompt] = []
    for where, obj in jsonl_objects(path):
        first, turns = _first_user_turn(obj, where)
        if not first.strip():
            raise DspecError(f"{where}: the first turn is empty")
        prompts.append(Prompt(first, obj.get("domain", ""), turns, where))
    if not prompts:
        raise DspecError(f"dataset {'builtin prompts' if str(path) == BUILTIN else path}: no prompts")
    return prompts[:limit] if limit else prompts


# ShareGPT / OpenAI role names -> chat-template roles
ROLES = {
    "system": "system", "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
}


@dataclass
class Conversation:
    """One dialogue: ``messages`` are ``{"role": system|user|assistant, "content": str}``."""

    id: str
    messages: list[dict[str, str]]
    where: str  # file:line it came from
    chat_template_kwargs: dict | None = None  # what the line records (regenerated data); None: not recorded

    def without_assistant(self) -> list[dict[str, str]]:
        """System and user turns only (the prompts of a regeneration)."""
        return [m for m in self.messages if m["role"] != "assistant"]


def _messages(obj: dict, where: str) -> list[dict[str, str]]:
    if "turns" in obj:
        return [{"role": "user", "content": t} for t in _first_user_turn(obj, where)[1]]
    conv = obj.get("conversations", obj.get("messages"))
    if conv is None:
        raise DspecError(f"{where}: line has no 'turns', 'conversations' or 'messages' field")
    if not isinstance(conv, list) or not conv:
        raise DspecError(f"{where}: 'conversations' / 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise DspecError(f"{where}: conversations[{i}] is not an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in ROLES:
            raise DspecError(f"{where}: conversations[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DspecError(f"{where}: conversations[{i}] has no string 'content'")
        out.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "user" for m in out):
        raise DspecError(f"{where}: 'conversations' has no user turn")
    return out


def load_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """Read ``{"turns": [...]}`` or ``{"id"?, "conversations"|"messages": [...]}`` lines.

    ShareGPT ``{"from", "value"}`` messages and role names (human, gpt, ...) are accepted. A
    line without ``id`` gets ``<file stem>-<line>``; duplicate ids are an error. A line's
    ``chat_template_kwargs`` (an object, when present) is kept on its conversation.
    """
    convs: list[Conversation] = []
    seen: dict[str, str] = {}
    for where, obj in jsonl_objects(path):
        if limit and len(convs) >= limit:
            break
        cid = obj.get("id", f"{Path(str(path)).stem}-{where.rsplit(':', 1)[1]}")
        if not isinstance(cid, str | int) or isinstance(cid, bool):
            raise DspecError(f"{where}: 'id' must be a string or an integer")
        cid = str(cid)
        if cid in seen:
            raise DspecError(f"{where}: duplicate id {cid!r} (first at {seen[cid]})")
        seen[cid] = where
        kwargs = obj.get("chat_template_kwargs")
        kwargs = None if kwargs is None else check_kwargs(kwargs, f"{where}: chat_template_kwargs")
        convs.append(Conversation(cid, _messages(obj, where), where, kwargs))
    if not convs:
        raise DspecError(f"dataset {path}: no conversations")
    return convs


def dataset_name(path: str | Path) -> str:
    return BUILTIN if str(path) == BUILTIN else Path(path).stem
