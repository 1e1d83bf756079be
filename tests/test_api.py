"""The plugin-author API (``dspec_cli.__all__``): what type checkers see, what docs/plugins.md
documents and what loads at run time are the same names; ``import dspec_cli`` stays light; every
tensor argument of the public API and of ``runtime/`` states its shape."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dspec_cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dspec_cli"


def _type_checking_imports() -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in dspec_cli/__init__.py."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.unparse(imp)
                out |= {alias.asname or alias.name: imp.module or "" for alias in imp.names}
    return out


def test_type_checkers_see_the_lazy_names():
    assert _type_checking_imports() == dspec_cli._API


def test_every_name_resolves():
    assert dspec_cli.__all__ == ["__version__", "hookimpl", *dspec_cli._API]  # spelled out, in _API's order
    for name in dspec_cli.__all__:
        assert getattr(dspec_cli, name) is not None, name
    assert sorted(dir(dspec_cli)) == sorted(dspec_cli.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dspec_cli.nope  # noqa: B018 - the attribute access is the test


def test_docs_list_exactly_the_public_api():
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("## The public API") : text.index("## A complete drafter plugin")]
    documented = {name for row in re.findall(r"^\| (`.+?`) \|", section, re.M) for name in re.findall(r"`(\w+)`", row)}
    assert documented == set(dspec_cli.__all__)


def test_import_stays_light():
    code = "import sys, dspec_cli; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- tensor shapes -----------------------------------------------------------------------------------

SHAPE_MODULES = (
    [p for p in (PACKAGE / "runtime").rglob("*.py")]
    + list((PACKAGE / "nn").rglob("*.py"))
    + list((PACKAGE / "checkpoints" / "layouts").rglob("*.py"))
    + [PACKAGE / "core" / f for f in ("types.py", "calibration.py", "hardware.py", "ragged.py", "sampling.py")]
)


def _states_shape(arg: ast.arg, lines: list[str], doc: str) -> bool:
    """A shape ``[...]`` in a comment on the argument's line, or after its name in the docstring."""
    line = lines[arg.lineno - 1]
    if "#" in line and "[" in line.split("#", 1)[1]:
        return True
    return bool(re.search(rf"\b{re.escape(arg.arg)}\b[^.\n]{{0,60}}\[", doc))


def unstated_shapes(path: Path, base: Path = PACKAGE) -> list[str]:
    """Public functions of ``path`` with a ``torch.Tensor`` argument whose shape is not stated."""
    text = path.read_text()
    lines, bad = text.splitlines(), []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.FunctionDef) or (node.name.startswith("_") and node.name not in ("__init__", "__call__")):
            continue
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        tensors = [a for a in args if a.annotation is not None and "Tensor" in ast.unparse(a.annotation)]
        missing = [a.arg for a in tensors if not _states_shape(a, lines, ast.get_docstring(node) or "")]
        if missing:
            bad.append(f"{path.relative_to(base)}:{node.lineno} {node.name}({', '.join(missing)})")
    return bad


def test_tensor_arguments_state_their_shapes():
    bad = [line for p in SHAPE_MODULES for line in unstated_shapes(p)]
    assert bad == []


def test_shape_checker_can_fail(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def good(x: torch.Tensor, y: torch.Tensor):\n"
        "    '''x [R, V] and y [R].'''\n"
        "def bad(x: torch.Tensor, y: torch.Tensor):  # nothing here\n"
        "    '''x [R].'''\n"
    )
    assert unstated_shapes(tmp_path / "m.py", tmp_path) == ["m.py:4 bad(y)"]
