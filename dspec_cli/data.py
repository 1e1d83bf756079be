"""Prompt sets: jsonl files of ``{"turns": [...]}`` or ShareGPT ``{"conversations": [...]}``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspec_cli.errors import DspecError

BUILTIN = "builtin"  # name of the project's own prompt set (dspec_cli/assets/prompts.jsonl)


@dataclass
class Prompt:
    text: str  # the first user turn
    domain: str = ""
    turns: tuple[str, ...] = ()


def _first_user_turn(obj: dict, where: str) -> tuple[str, tuple[str, ...]]:
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DspecError(f"{where}: 'turns' must be a non-empty list of strings")
        return turns[0], tuple(turns)
    if "conversations" in obj:
        conv = obj["conversations"]
        users = [m.get("content") for m in conv if isinstance(m, dict) and m.get("role") in ("user", "human")]
        if not users or not isinstance(users[0], str):
            raise DspecError(f"{where}: 'conversations' has no user turn")
        return users[0], tuple(users)
    raise DspecError(f"{where}: line has no 'turns' (or 'conversations') field")


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file; a malformed line is an error naming file and line (never skipped)."""
    if str(path) == BUILTIN:
        text = resources.files("dspec_cli").joinpath("assets/prompts.jsonl").read_text()
        name = "builtin prompts"
    else:
        p = Path(path)
        if not p.is_file():
            raise DspecError(f"dataset {path}: file not found")
        text, name = p.read_text(encoding="utf-8"), str(p)
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DspecError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DspecError(f"{where}: expected a JSON object")
        first, turns = _first_user_turn(obj, where)
        if not first.strip():
            raise DspecError(f"{where}: the first turn is empty")
        prompts.append(Prompt(first, obj.get("domain", ""), turns))
    if not prompts:
        raise DspecError(f"dataset {name}: no prompts")
    return prompts[:limit] if limit else prompts


def dataset_name(path: str | Path) -> str:
    return BUILTIN if str(path) == BUILTIN else Path(path).stem
