"""Plugin system: entry points, third-party packages, in-process registration, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dspec_cli import hookimpl
from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.core.types import Proposal
from dspec_cli.runtime.drafter import Drafter

ECHO_PLUGIN = '''
import torch
from dspec_cli import hookimpl
from dspec_cli import Drafter, Proposal


class EchoDrafter(Drafter):
    """Drafts the anchor repeated: trivial but real."""

    name = "echo"
    capabilities = frozenset({"confidence"})

    def propose(self, state, anchors, max_len, sampler):
        tokens = anchors[:, None].repeat(1, max_len)
        lengths = torch.full_like(anchors, max_len)
        return Proposal(tokens=tokens, lengths=lengths)


@hookimpl
def dspec_register_drafters(register):
    register(EchoDrafter, aliases=("parrot",))
'''


def _make_package(root: Path, dist: str, module: str, source: str, version: str = "1.2.3") -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(source)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "{version}"

            [project.entry-points.dspec]
            {dist} = "{module}"
            """
        )
    )
    return pkg


def _pip_install(pkg: Path, target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(pkg)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _dspec(args: list[str], site: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    if site is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dspec_cli", *args], capture_output=True, text=True, env=full_env)


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory) -> Path:
    """A real pip-installed third-party plugin, plus one that raises on import."""
    root = tmp_path_factory.mktemp("plugins")
    site = root / "site"
    _pip_install(_make_package(root, "dspec-echo", "dspec_echo", ECHO_PLUGIN), site)
    _pip_install(_make_package(root, "dspec-broken", "dspec_broken", "raise RuntimeError('boom')\n", "0.1"), site)
    return site


def test_third_party_plugin_is_listed_and_usable(third_party_site):
    out = _dspec(["drafters", "--json", "-"], third_party_site)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = {row["name"]: row for row in data["drafters"]}
    assert rows["echo"]["package"] == "dspec-echo"
    assert rows["echo"]["version"] == "1.2.3"
    assert rows["echo"]["aliases"] == ["parrot"]
    assert "prompt-lookup" in rows  # built-ins still list
    # the broken plugin is reported in one line naming it, and listing still works
    broken = [p for p in data["problems"] if "dspec-broken" in p]
    assert len(broken) == 1 and "boom" in broken[0] and "\n" not in broken[0]
    assert "dspec-broken" in out.stderr

    use = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from dspec_cli.core.plugins import get_drafter_class as g; from dspec_cli.checkpoints.config import DrafterConfig;"
            "d = g('parrot')(DrafterConfig(block_size=3), None); p = d.propose(d.init_state(), torch.tensor([5, 7]), 3, None);"
            "print(p.tokens.tolist(), p.lengths.tolist())",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(third_party_site)},
    )
    assert use.returncode == 0, use.stderr
    assert use.stdout.strip() == "[[5, 5, 5], [7, 7, 7]] [3, 3]"


def test_load_plugins_env_restricts(third_party_site):
    out = _dspec(["drafters", "--json", "-"], third_party_site, env={"DSPEC_LOAD_PLUGINS": "dspec-echo"})
    names = {row["name"] for row in json.loads(out.stdout)["drafters"]}
    assert names == {"echo"}
    out = _dspec(["drafters", "--json", "-"], third_party_site, env={"DSPEC_LOAD_PLUGINS": ""})
    report = json.loads(out.stdout)
    assert report["drafters"] == []
    # restricting plugins never removes the core schedulers
    assert {row["name"] for row in report["schedulers"]} == {"fixed", "threshold", "hardware", "async"}


def test_table_output_lists_builtins():
    out = _dspec(["drafters"])
    assert out.returncode == 0
    assert "prompt-lookup" in out.stdout


class _Dup(Drafter):
    name = "prompt-lookup"


class _Fresh(Drafter):
    name = "in-process-test"
    capabilities = frozenset({"draft_probs"})


class _InProcessPlugin:
    __name__ = "in-process-plugin"

    @hookimpl
    def dspec_register_drafters(self, register):
        register(_Fresh)
        register(_Dup)


def test_in_process_register_duplicate_and_unregister():
    plugins.load_plugins()
    plugins.pm.register(_InProcessPlugin(), name="undo-in-process")
    try:
        reg = plugins.registry()
        assert reg.drafters["in-process-test"].cls is _Fresh
        assert reg.drafters["prompt-lookup"].cls is not _Dup  # first registration wins
        dup = [p for p in reg.problems if "'prompt-lookup' is already registered" in p]
        assert len(dup) == 1 and "undo-in-process" in dup[0]
        assert plugins.get_drafter_class("in-process-test") is _Fresh
    finally:
        plugins.pm.unregister(name="undo-in-process")
    assert "in-process-test" not in plugins.registry().drafters


def test_unknown_drafter_names_known_ones():
    with pytest.raises(DspecError, match="unknown drafter 'nope'; known drafters: .*prompt-lookup"):
        plugins.get_drafter_class("nope")


def test_cli_error_is_one_line():
    out = _dspec(["drafters", "--bogus"])
    assert out.returncode != 0
    assert "Traceback" not in out.stderr


def test_proposal_contract_of_builtin_prompt_lookup():
    cls = plugins.get_drafter_class("prompt-lookup")
    d = cls(cls.config_class(block_size=4), None)
    state = d.init_state()
    d.add_requests(state, [torch.tensor([1, 2, 3, 4, 1, 2]), torch.tensor([9, 8])], None)
    p = d.propose(state, torch.tensor([3, 7]), 4, None)
    assert isinstance(p, Proposal)
    assert p.lengths.tolist() == [4, 0]  # "1 2 3" seen before -> "4 1 2 3"; no match for row 2
    assert p.tokens[0].tolist() == [4, 1, 2, 3]


def test_prompt_lookup_drafts_a_whole_block_inside_a_loop():
    """In a period-2 loop the latest match of the tail is 2 tokens back: the draft must come from
    a match with a whole block after it, not stop at the context's end."""
    from dspec_prompt_lookup import lookup

    loop = torch.tensor([9, 4, 5, 6, 5, 6, 5, 6, 5, 6])
    assert lookup(loop, 4, 3, 1).tolist() == [5, 6, 5, 6]
    recent = torch.tensor([1, 2, 7, 8, 8, 8, 1, 2, 3, 4, 4, 4, 1, 2])  # two matches of [1, 2]
    assert lookup(recent, 3, 2, 1).tolist() == [3, 4, 4]  # the most recent with 3 tokens after it
    assert lookup(recent, 7, 2, 1).tolist() == [7, 8, 8, 8, 1, 2, 3]  # only the earliest has 7
