"""Readers for the offline text sources: Debian packages plus the CPython standard library.

Every reader returns plain Python data (strings, (title, text) pairs); nothing here tokenizes.
"""

import ast
import gzip
import os
import re
import struct
import subprocess
import sysconfig
import textwrap
import zlib
from pathlib import Path

APT_PACKAGES = [
    "bible-kjv", "bible-kjv-text", "fortunes", "jargon-text", "debian-reference-en",
    "python3.11-doc", "r-cran-janeaustenr", "gnu-standards", "debian-faq",
]
AUSTEN_RDB = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")
PY_INFO = Path("/usr/share/info/python3.11.info.gz")
GNU_INFO = [Path("/usr/share/info/standards.info.gz"), Path("/usr/share/info/maintain.info.gz")]
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
DEBIAN_FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz")
DEBIAN_REF = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
FORTUNES = Path("/usr/share/games/fortunes")
# Python manual chapters kept: tutorial, setup, language reference, library, HOWTOs, FAQ, glossary.
PY_INFO_CHAPTERS = {2, 3, 4, 5, 10, 11, 12}
_SKIP_CODE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
                   "pydoc_data", "__pycache__", "turtledemo", "config-3.11-x86_64-linux-gnu"}


def missing_packages() -> list[str]:
    """The text packages not installed (all of them where there is no dpkg: not Debian/Ubuntu)."""
    try:
        return [p for p in APT_PACKAGES
                if subprocess.run(["dpkg", "-s", p], capture_output=True, check=False).returncode != 0]
    except FileNotFoundError:
        return list(APT_PACKAGES)


def install_packages(install: bool) -> None:
    """Check the text packages are there; install the missing ones with apt-get only when
    ``install`` (needs root), else stop naming them and the command that installs them."""
    missing = missing_packages()
    if not missing:
        return
    command = f"apt-get install -y --no-install-recommends {' '.join(missing)}"
    if not install:
        raise SystemExit(f"error: the corpus reads these Debian/Ubuntu packages, not installed here: "
                         f"{', '.join(missing)}. Install them with `{command}` (as root), or rerun with "
                         "--install-packages to let build.py run apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(command.split(), check=True, env=env, stdout=subprocess.DEVNULL)


def _clean(text: str) -> str:
    """Normalise non-breaking spaces and trailing blanks; collapse 3+ newlines."""
    text = text.replace("\xa0", " ").replace("\r", "")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ---------------------------------------------------------------- code

def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, source) of the running interpreter's stdlib *.py, without tests/data."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_CODE_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if 200 <= len(text) <= 400_000:
            out.append((str(rel), text.replace("\r", "")))
    return out


def stdlib_functions(files: list[tuple[str, str]]) -> list[dict]:
    """Public functions and methods with a docstring, 5-45 lines, dedented.

    Keys: file, name, owner (class or None), signature, doc, source, stub (def + docstring),
    body_without_doc, imports (module-level import statements the source refers to).
    """
    out = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.split("\n")
        imports = [ast.get_source_segment(text, n) for n in tree.body
                   if isinstance(n, (ast.Import, ast.ImportFrom)) and n.col_offset == 0]
        for node, owner in _functions(tree):
            doc = ast.get_docstring(node)
            if not doc or len(node.body) < 2 or node.decorator_list or node.name.startswith("_"):
                continue
            first = node.body[0]
            if not 5 <= node.end_lineno - node.lineno + 1 <= 45:
                continue
            src = _span(lines, node.lineno, node.end_lineno)
            stub = _span(lines, node.lineno, first.end_lineno)
            bare = _span(lines, node.lineno, first.lineno - 1, first.end_lineno + 1, node.end_lineno)
            used = [imp for imp in imports if any(
                re.search(rf"\b{re.escape((a.asname or a.name).split('.')[0])}\b", src)
                for a in ast.walk(ast.parse(imp)) if isinstance(a, ast.alias))]
            out.append({"file": rel, "name": node.name, "owner": owner,
                        "signature": f"{node.name}({ast.unparse(node.args)})", "doc": doc,
                        "source": src, "stub": stub, "body_without_doc": bare, "imports": used})
    return out


def _span(lines: list[str], *bounds: int) -> str:
    """Dedented text of 1-based inclusive line ranges (a1, b1, a2, b2, ...)."""
    parts = [ln for a, b in zip(bounds[::2], bounds[1::2], strict=False) for ln in lines[a - 1:b]]
    return textwrap.dedent("\n".join(parts))


def _functions(tree: ast.Module):
    """Yield (FunctionDef, owning class name or None) for top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node, None
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    yield sub, node.name


def module_docstrings(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(dotted module name, module docstring) for stdlib modules with a useful docstring."""
    out = []
    for rel, text in files:
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            continue
        if doc and len(doc) > 80:
            mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
            out.append((mod, doc))
    return out


# ---------------------------------------------------------------- docs

def pydoc_topics() -> dict[str, str]:
    """The interpreter's pydoc topic texts (keyword and syntax help)."""
    from pydoc_data.topics import topics
    return {k: _clean(v) for k, v in topics.items()}


_NOTE = re.compile(r"\*[Nn]ote[ \n]+([^:*]+?)::?(?:[ \n]+[^ \n.,;]+[.,])?", re.S)
_HEADING = re.compile(r"^(\d+(?:\.\d+)*)\.? (.+)$")


def info_nodes(path: Path) -> list[tuple[int, str, str]]:
    """(chapter, title, text) of every node of a Texinfo .info.gz, cross references resolved."""
    raw = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    out, chapter = [], 0
    for node in raw.split("\x1f")[1:]:
        if not node.startswith("\nFile:") or "Node: Index" in node[:200]:
            continue
        body = node.split("\n", 2)[2] if node.count("\n") >= 2 else ""
        body = body.split("   ---------- Footnotes ----------")[0]
        body = re.sub(r"\* Menu:.*", "", body, flags=re.S)
        body = _NOTE.sub(lambda m: " ".join(m.group(1).split()), body)
        lines = [ln for ln in body.split("\n")
                 if not re.fullmatch(r"[*=.\-]{4,}", ln.strip())]
        text = _clean("\n".join(lines))
        if not text:
            continue
        title_line = text.split("\n", 1)[0]
        m = _HEADING.match(title_line)
        if m:
            chapter = int(m.group(1).split(".")[0])
            title = m.group(2).strip()
        else:
            title = title_line.strip()
        if len(text) > 200:
            out.append((chapter, title, text))
    return out


def python_manual() -> list[tuple[str, str]]:
    """(title, text) nodes of the Python 3.11 manual, chapters in PY_INFO_CHAPTERS."""
    return [(t, x) for c, t, x in info_nodes(PY_INFO) if c in PY_INFO_CHAPTERS]


def gnu_standards() -> list[tuple[str, str]]:
    """(title, text) nodes of the GNU coding standards and maintainers' guide."""
    return [(t, x) for p in GNU_INFO for _, t, x in info_nodes(p)]


def jargon_entries() -> list[tuple[str, str]]:
    """(term, definition) pairs of the Jargon File."""
    text = gzip.decompress(JARGON.read_bytes()).decode("utf-8", errors="replace")
    parts = re.split(r"\n   :([^:\n]{1,60}):[^\n]*\n", text)
    out = []
    for term, body in zip(parts[1::2], parts[2::2], strict=False):
        body = _clean("\n".join(ln[3:] if ln.startswith("   ") else ln for ln in body.split("\n")))
        if len(body) > 60:
            out.append((term.strip(), body))
    return out


def _gz_text(path: Path) -> str:
    return _clean(gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))


def debian_faq() -> list[tuple[str, str]]:
    """(question, answer) pairs from the Debian FAQ (sections whose heading ends with '?')."""
    text = _gz_text(DEBIAN_FAQ)
    parts = re.split(r"\n(\d+(?:\.\d+)+)\. +([^\n]+(?:\n[^\n ][^\n]*)?)\n\n", text)
    out = []
    for head, body in zip(parts[2::3], parts[3::3], strict=False):
        head = " ".join(head.split())
        body = _clean("\n".join(ln[4:] if ln.startswith("    ") else ln for ln in body.split("\n")))
        if head.endswith("?") and len(body) > 80:
            out.append((head, body))
    return out


def debian_texts() -> list[str]:
    """The Debian Reference and the Debian FAQ as plain text (body only, TOC dropped)."""
    out = []
    for path in (DEBIAN_REF, DEBIAN_FAQ):
        text = _gz_text(path)
        out += [p for p in re.split(r"\n(?=\d+\.\d+\. )", text) if len(p) > 200]
    return out


# ---------------------------------------------------------------- prose

def _r_strings(blob: bytes) -> list[str]:
    """Decode one XDR-serialised R character vector (format 'X', version 2 or 3)."""
    if blob[:2] != b"X\n":
        raise ValueError("austen: expected an XDR R serialisation")
    pos = 2
    version = struct.unpack(">i", blob[pos:pos + 4])[0]
    pos += 12
    if version == 3:
        nelen = struct.unpack(">i", blob[pos:pos + 4])[0]
        pos += 4 + nelen
    flags, length = struct.unpack(">ii", blob[pos:pos + 8])
    if flags & 0xFF != 16:
        raise ValueError("austen: expected a character vector (STRSXP)")
    pos += 8
    out = []
    for _ in range(length):
        _, n = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        if n < 0:
            out.append("")
            continue
        out.append(blob[pos:pos + n].decode("utf-8", errors="replace"))
        pos += n
    return out


def austen_novels() -> list[list[str]]:
    """The six novels of r-cran-janeaustenr, each as a list of chapters (paragraphs joined)."""
    data, pos, novels = AUSTEN_RDB.read_bytes(), 0, []
    while pos + 4 < len(data):
        d = zlib.decompressobj()
        blob = d.decompress(data[pos + 4:])
        pos = len(data) - len(d.unused_data)
        lines = _r_strings(blob)
        paras, cur = [], []
        for ln in lines + [""]:
            if ln.strip():
                cur.append(ln.strip())
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        chapters, cur = [], []
        for p in paras:
            if re.fullmatch(r"(CHAPTER|Chapter) [0-9IVXLC]+\.?", p) and cur:
                chapters.append("\n\n".join(cur))
                cur = []
            cur.append(p)
        chapters.append("\n\n".join(cur))
        novels.append(chapters)
    return novels


def kjv_chapters() -> list[tuple[str, list[str]]]:
    """(chapter name, verses) of the King James Bible, dumped with the `bible` program."""
    out = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    chapters, name, verses = [], None, []
    for line in out.split("\n"):
        m = re.match(r"^  ?\s*(\d+) (.*)$", line)
        if line and not line[0].isspace() and re.search(r" \d+$", line):
            if name and verses:
                chapters.append((name, verses))
            name, verses = line.strip(), []
        elif m and line.startswith(" "):
            verses.append(m.group(2).strip())
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
    if name and verses:
        chapters.append((name, verses))
    return chapters


def fortunes() -> list[str]:
    """Every fortune cookie of the (non-offensive) fortunes files, '%'-separated."""
    out = []
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        out += [_clean(c) for c in re.split(r"\n%\n", text) if 20 <= len(c.strip()) <= 1200]
    return out
