"""The package's layers (docs/architecture.md), checked on the source with ``ast``.

* Each subpackage of ``dspec_cli`` imports only its own layer and the layers below it:
  core < nn < checkpoints < runtime < {training, workflows, testing} < cli. The three at the
  same level do not import each other.
* Imports under ``if TYPE_CHECKING:`` are annotations only and may name a higher layer.
* No module-level import cycle between modules, and none through annotation-only imports either
  (``checkpoints/`` takes drafter classes as arguments and never names ``runtime.drafter``).
* No function-level import of the package's own modules outside ``cli/`` (where command bodies
  import their workflow lazily so ``dspec --help`` does not load torch) and the allow-list below.
* Internal modules never import the root ``dspec_cli`` (the plugin API re-exports them).
* Plugins import only the public API: ``dspec_cli``, ``dspec_cli.nn``,
  ``dspec_cli.checkpoints.layouts``, their own package and other plugins' package roots.
* At most 12 modules directly in ``dspec_cli/``.
* A checkpoint's config.json is read in ``checkpoints/`` only (``read_config`` is imported nowhere
  else), into its typed record, and ``runtime/`` reads no weights file (no safetensors).
* The target has one level, the static one: the ragged level's names stay gone.
* Drafters come from checkpoints through ``load_drafter`` only: outside ``checkpoints/`` no call
  of a ``from_pretrained`` / ``load_default`` except a drafter class's own delegation (inside a
  method of that name) and transformers' classes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dspec_cli"
PLUGINS = ROOT / "plugins"

RANK = {"core": 0, "nn": 1, "checkpoints": 2, "runtime": 3, "training": 4, "workflows": 4, "testing": 4, "cli": 5}
LAZY_ALLOWED = {
    # triton is an optional dependency and its import is slow: loaded on first Triton verify
    ("dspec_cli.runtime.verify", "dspec_cli.runtime.verify.triton"),
    ("dspec_cli.runtime.verify", "dspec_cli.runtime.verify.triton_block"),
}
PLUGIN_API = ("dspec_cli", "dspec_cli.nn", "dspec_cli.checkpoints.layouts")
LOADERS = ("from_pretrained", "load_default")  # drafter constructors from a checkpoint or the embedded default
MAX_TOP_LEVEL_MODULES = 12


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (a package's __init__ is the package name)
    line: int
    lazy: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(node: ast.ImportFrom, source: str, is_package: bool, known: set[str]) -> list[str]:
    if node.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = []
    for alias in node.names:  # `from pkg import submodule` imports the submodule
        sub = f"{module}.{alias.name}"
        out.append(sub if sub in known else module)
    return out


def edges(base: Path, folder: Path, prefixes: tuple[str, ...], known: set[str]) -> list[Edge]:
    """Imports of every module under ``folder`` (module names relative to ``base``)."""
    found: list[Edge] = []
    for path in sorted(folder.rglob("*.py")):
        source = module_name(path, base)
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, lazy: bool, typing_only: bool, source: str = source, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, True, typing_only)
                elif isinstance(child, ast.If) and _is_type_checking(child):
                    visit(child, lazy, True)
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.startswith(prefixes):
                            found.append(Edge(source, alias.name, child.lineno, lazy, typing_only))
                elif isinstance(child, ast.ImportFrom):
                    for target in _resolve(child, source, path.name == "__init__.py", known):
                        if target.startswith(prefixes):
                            found.append(Edge(source, target, child.lineno, lazy, typing_only))
                else:
                    visit(child, lazy, typing_only)

        visit(tree, False, False)
    return found


KNOWN = {module_name(p, ROOT) for p in PACKAGE.rglob("*.py")}
PACKAGE_EDGES = edges(ROOT, PACKAGE, ("dspec_cli",), KNOWN)


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def layer_violations(all_edges: list[Edge]) -> list[str]:
    bad = []
    for e in all_edges:
        src, dst = layer(e.source), layer(e.target)
        where = f"{e.source}:{e.line} imports {e.target}"
        if e.source != "dspec_cli" and e.target == "dspec_cli":
            bad.append(f"{where} (internal modules import the defining module, not the root API)")
        if src is None or dst is None or e.typing_only or src == dst:
            continue
        if RANK[dst] >= RANK[src]:
            bad.append(f"{where} ({src} may not import {dst})")
    return bad


def lazy_violations(all_edges: list[Edge]) -> list[str]:
    return [f"{e.source}:{e.line} imports {e.target} inside a function"
            for e in all_edges if e.lazy and layer(e.source) != "cli" and (e.source, e.target) not in LAZY_ALLOWED]


def cycles(all_edges: list[Edge], typing: bool = False) -> list[list[str]]:
    """Strongly connected components (> 1 module) of the module-level import graph (``typing``:
    with the imports under ``if TYPE_CHECKING:``)."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        if not e.lazy and (typing or not e.typing_only) and e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            strongconnect(v)
    return out


def _package_is_parent(a: str, b: str) -> bool:
    """Importing a submodule runs its package's __init__: that edge is no cycle of ours."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_layers_import_downwards_only():
    assert PACKAGE_EDGES, "no imports found: the checker is broken"
    assert layer_violations(PACKAGE_EDGES) == []


def test_no_function_level_imports_of_the_package():
    assert lazy_violations(PACKAGE_EDGES) == []


def test_no_import_cycles():
    own = [e for e in PACKAGE_EDGES if not _package_is_parent(e.source, e.target)]
    assert cycles(own) == []
    assert cycles(own, typing=True) == []  # annotations may name a higher layer, but not in a loop


def test_plugins_use_only_the_public_api():
    plugin_packages = {p.name for p in PLUGINS.iterdir() if (p / "__init__.py").is_file()}
    bad = []
    for e in edges(PLUGINS, PLUGINS, ("dspec_cli",) + tuple(plugin_packages), KNOWN):
        own = e.source.split(".")[0]
        if e.target.startswith("dspec_cli"):
            if e.target not in PLUGIN_API:
                bad.append(f"{e.source}:{e.line} imports {e.target}")
        elif e.target.split(".")[0] != own and "." in e.target:
            bad.append(f"{e.source}:{e.line} imports {e.target} (another plugin's internals)")
    assert bad == []


def test_package_top_level_stays_small():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def stray_drafter_loads(base: Path, folders: list[Path]) -> list[str]:
    """Calls of ``X.from_pretrained`` / ``X.load_default`` that bypass ``load_drafter``."""
    bad = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            if (PACKAGE / "checkpoints") in path.parents:
                continue
            tree = ast.parse(path.read_text(), str(path))
            hf = {"transformers"} | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                                     and (n.module or "").split(".")[0] == "transformers" for a in n.names}

            def visit(node: ast.AST, function: str, rel: str, hf: set[str] = hf) -> None:
                for child in ast.iter_child_nodes(node):
                    name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                    call = child.func if isinstance(child, ast.Call) else None
                    if (isinstance(call, ast.Attribute) and call.attr in LOADERS and function not in LOADERS
                            and _root_name(call.value) not in hf):
                        bad.append(f"{rel}:{child.lineno} calls {call.attr} (use dspec_cli.checkpoints.load_drafter)")
                    visit(child, name, rel)

            visit(tree, "", str(path.relative_to(base)))
    return bad


CHECKPOINT_READERS = ("read_config",)  # a checkpoint folder's raw config.json (core/files.py)


def stray_checkpoint_reads(folder: Path) -> list[str]:
    """Imports of the raw config.json reader outside ``checkpoints/``."""
    bad = []
    for path in sorted(folder.rglob("*.py")):
        if (folder / "checkpoints") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name in CHECKPOINT_READERS for a in node.names):
                bad.append(f"{path.relative_to(folder)}:{node.lineno} imports {node.module}.read_config")
    return bad


def test_checkpoint_files_are_read_in_checkpoints():
    assert stray_checkpoint_reads(PACKAGE) == []
    assert [e for e in edges(ROOT, PACKAGE / "runtime", ("safetensors",), KNOWN)] == []


REMOVED = {  # module -> names it no longer defines (the ragged level of Target and its types)
    "runtime/target.py": ("verify", "verify_tree", "commit", "commit_path", "remove", "forward_full"),
    "runtime/kv_cache.py": ("PendingStep", "require_idle"),
    "core/types.py": ("StepOutput",),
}


def test_removed_names_stay_removed():
    back = []
    for rel, names in REMOVED.items():
        tree = ast.parse((PACKAGE / rel).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        back += [f"{rel}: {name}" for name in names if name in defined]
    assert back == []


def test_drafters_load_through_load_drafter():
    assert stray_drafter_loads(ROOT, [PACKAGE, PLUGINS, ROOT / "benchmarks"]) == []


# -- the checker itself can fail ------------------------------------------------------------


def _edges_of(tmp_path: Path, files: dict[str, str]) -> list[Edge]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    known = {module_name(p, tmp_path) for p in tmp_path.rglob("*.py")}
    return edges(tmp_path, tmp_path, ("dspec_cli",), known)


@pytest.mark.parametrize("files, check, expected", [
    ({"dspec_cli/core/a.py": "from dspec_cli.runtime import engine\n", "dspec_cli/runtime/engine.py": ""},
     layer_violations, ["dspec_cli.core.a:1 imports dspec_cli.runtime.engine (core may not import runtime)"]),
    ({"dspec_cli/training/a.py": "from dspec_cli.workflows.bench import x\n", "dspec_cli/workflows/bench.py": ""},
     layer_violations, ["dspec_cli.training.a:1 imports dspec_cli.workflows.bench (training may not import workflows)"]),
    ({"dspec_cli/runtime/a.py": "def f():\n    from dspec_cli.core import b\n", "dspec_cli/core/b.py": ""},
     lazy_violations, ["dspec_cli.runtime.a:2 imports dspec_cli.core.b inside a function"]),
    ({"dspec_cli/runtime/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dspec_cli.cli import x\n",
      "dspec_cli/cli/x.py": ""}, layer_violations, []),
])
def test_checker_flags_violations(tmp_path, files, check, expected):
    assert check(_edges_of(tmp_path, files)) == expected


def test_checker_finds_cycles(tmp_path):
    found = cycles(_edges_of(tmp_path, {"dspec_cli/core/a.py": "from dspec_cli.core import b\n",
                                        "dspec_cli/core/b.py": "from dspec_cli.core.a import f\n"}))
    assert found == [["dspec_cli.core.a", "dspec_cli.core.b"]]
    annotated = _edges_of(tmp_path / "typing", {
        "dspec_cli/checkpoints/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dspec_cli.runtime.b import D\n",
        "dspec_cli/runtime/b.py": "from dspec_cli.checkpoints.a import f\n"})
    assert cycles(annotated) == [] and cycles(annotated, typing=True) == [["dspec_cli.checkpoints.a", "dspec_cli.runtime.b"]]


def test_checker_finds_stray_checkpoint_reads(tmp_path):
    for rel in ("checkpoints/native.py", "runtime/drafter.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("from dspec_cli.core.files import CONFIG_FILE, read_config\n")
    assert stray_checkpoint_reads(tmp_path) == ["runtime/drafter.py:1 imports dspec_cli.core.files.read_config"]


def test_checker_finds_stray_drafter_loads(tmp_path):
    (tmp_path / "a.py").write_text(
        "from transformers import AutoTokenizer\n"
        "def run(cls, path, target):\n"
        "    AutoTokenizer.from_pretrained(path)\n"  # transformers: fine
        "    return cls.from_pretrained(path, target)\n"  # bypasses load_drafter
        "class D:\n"
        "    @classmethod\n"
        "    def load_default(cls, target):\n"
        "        return cls.from_pretrained('x', target)\n"  # a drafter's own delegation: fine
    )
    assert stray_drafter_loads(tmp_path, [tmp_path]) == ["a.py:4 calls from_pretrained (use dspec_cli.checkpoints.load_drafter)"]
