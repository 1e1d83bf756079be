"""README.md's commands run as written: every ``dspec ...`` line of its code blocks (templates,
which hold a ``<...>`` placeholder, aside) runs in order in a fresh folder, with smaller sizes
appended (for an option given twice the last value wins), so a README command that breaks fails
here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from tiny_models import run_cli

REPO = Path(__file__).resolve().parents[1]


def readme_commands(text: str) -> tuple[list[list[str]], list[list[str]]]:
    """(runnable, templates): the ``dspec`` command lines of the code blocks, without ``dspec``
    and comments; continuation lines joined."""
    runnable, templates = [], []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["dspec"]:
                (templates if any("<" in w for w in words) else runnable).append(words[1:])
    return runnable, templates


def smaller(args: list[str]) -> list[str]:
    """``args`` with flags appended that make the run small (same command, fewer prompts and tokens)."""
    command = args[0]
    if command == "bench":
        return [*args, "--num-prompts", "2", "--max-new-tokens", "8"]
    if command == "profile-hardware":
        sizes = ["--requests", "1"] if "--drafter" in args else ["--grid", "1,2"]
        return [*args, *sizes, "--repeats", "1", "--warmup", "0"]
    if command == "calibrate":
        return [*args, "--num-prompts", "2", "--max-new-tokens", "32", "--force"]
    if command == "data":
        return [*args, "--limit", "2", "--max-new-tokens", "32"]
    if command == "train":
        return [*args, "--max-steps", "1"]
    return args


RUNNABLE, TEMPLATES = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))


def test_readme_commands_are_found():
    """The README's quick starts: commands that run, and the Hub templates that need an account."""
    assert len(RUNNABLE) >= 12 and {c[0] for c in RUNNABLE} >= {"bench", "train", "data", "calibrate", "export"}
    assert [c[0] for c in TEMPLATES] == ["push", "bench"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A fresh folder where the README's relative paths into the repository resolve."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("recipes", "dspec_cli"):
        (root / name).symlink_to(REPO / name)
    return root


@pytest.mark.parametrize("args", RUNNABLE, ids=[" ".join(a)[:60] for a in RUNNABLE])
def test_readme_command_runs(args, workspace, capsys, monkeypatch):
    monkeypatch.chdir(workspace)
    code, _, err = run_cli(smaller(args), capsys)
    assert code == 0, f"dspec {shlex.join(args)}\n{err}"
