"""The output rule, one table: every command x every output option x {regular, same as an input,
same as another output, an existing folder, a FIFO with a reader, /dev/stdout into a pipe,
/dev/fd/N, /dev/full, a dangling symbolic link}.

A file output writes through every special file (the reader gets the whole output), follows a
dangling link (the link stays), and refuses a folder; a folder output takes an existing folder
and a dangling link, and refuses every special file. An output that is an input, or two outputs
that are one file, is a one-line usage error (exit 2) before anything loads. Every failure is one
``Error:`` line, nothing is left behind, and no input changes. Commands that must run do so on the
embedded tiny target at the smallest sizes (rows run in-process).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dspec_cli.core.files import ASSETS_DIR, embedded_path
from dspec_cli.core.hardware import CostTable

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/full").exists(), reason="POSIX only")

CKPT = embedded_path("drafters") / "dspark-markov"
TINY_RECIPE = """
[target]
name = "embedded"
dtype = "float32"
[data]
path = "{d}/train.jsonl"
max_length = 48
min_loss_tokens = 1
[drafter]
name = "dspark-markov"
block_size = 3
num_layers = 1
target_layer_ids = [0, 2, 4]
mask_token_id = 3
num_anchors = 2
markov_rank = 8
[train]
max_steps = 1
global_batch = 1
micro_batch = 1
dtype = "float32"
device = "cpu"
save_every = 0
"""


@dataclass(frozen=True)
class Output:
    command: str  # the command line, {d}: inputs, {t}: outputs, {o}: this output, {a}: the embedded assets
    option: str
    folder: bool  # a folder output
    other: str  # the command's other output option that takes {o} too ("" where it has none)
    reads: str  # an input file of the command (same-as-input rows of a file output)


BENCH = "bench -d prompt-lookup --num-prompts 1 --max-new-tokens 2 --dataset {d}/good.jsonl"
CAL = "calibrate -d dspark --traces {d}/traces.jsonl --force"
REGEN = "data regenerate --dataset {d}/good.jsonl --max-new-tokens 2 --concurrency 1"
TRAIN = "train --recipe {d}/tiny.toml"
PROFILE = "profile-hardware --grid 1 --contexts 8 --repeats 1 --warmup 0"
SCHED = "schedule --cost-table {d}/cost.json --traces {d}/traces.jsonl --steps 4 --concurrency 1"
EXPORT = "export {d}/ckpt --format vllm"
PUSH = "push {d}/ckpt --repo-id alice/x --dry-run"
OUTPUTS = [
    Output(BENCH + " --json {o}", "--json", False, "--plots", "{d}/good.jsonl"),
    Output(BENCH + " --plots {o}", "--plots", True, "--json", ""),
    Output(CAL + " -o {t}/c --json {o}", "--json", False, "--save-traces", "{d}/traces.jsonl"),
    Output(CAL + " -o {t}/c --save-traces {o}", "--save-traces", False, "--sglang-sts", "{d}/traces.jsonl"),
    Output(CAL + " -o {t}/c --sglang-sts {o}", "--sglang-sts", False, "--json", "{d}/traces.jsonl"),
    Output(CAL + " -o {o}", "--output", True, "--plots", ""),
    Output(CAL + " -o {t}/c --plots {o}", "--plots", True, "--json", ""),
    Output(REGEN + " -o {o}", "--output", False, "--json", "{d}/good.jsonl"),
    Output(REGEN + " -o {t}/r.jsonl --json {o}", "--json", False, "--output", "{d}/good.jsonl"),
    Output(TRAIN + " -o {t}/run --json-log {o}", "--json-log", False, "--feature-cache", "{d}/tiny.toml"),
    Output(TRAIN + " -o {o}", "--output", True, "--feature-cache", ""),
    Output(TRAIN + " -o {t}/run --feature-cache {o}", "--feature-cache", True, "--json-log", ""),
    Output(PROFILE + " --json {o}", "--json", False, "--plots", "{a}/tiny-target/config.json"),
    Output(PROFILE + " --plots {o}", "--plots", True, "--json", ""),
    Output(SCHED + " --json {o}", "--json", False, "--plots", "{d}/cost.json"),
    Output(SCHED + " --plots {o}", "--plots", True, "--json", ""),
    Output(EXPORT + " --output {t}/e --json {o}", "--json", False, "--output", "{d}/ckpt/config.json"),
    Output(EXPORT + " --output {o}", "--output", True, "--json", ""),
    Output(PUSH + " --json {o}", "--json", False, "", "{d}/ckpt/config.json"),
    Output("drafters --json {o}", "--json", False, "", "{a}/prompts.jsonl"),
    Output("datasets --json {o}", "--json", False, "", "{a}/prompts.jsonl"),
]
KINDS = ("regular", "same-as-input", "same-as-other-output", "directory", "fifo", "stdout-pipe", "dev-fd", "dev-full",
         "dangling-link")
ROWS = [(o, k) for o in OUTPUTS for k in KINDS if not (k == "same-as-other-output" and not o.other)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    (d / "good.jsonl").write_text('{"turns": ["Hello there"]}\n')
    (d / "traces.jsonl").write_text("".join(
        json.dumps({"drafter": "dspark-markov", "block_size": 7, "confidence": [0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1][:n],
                    "accepted": min(n, a)}) + "\n" for n in range(1, 8) for a in range(0, 8)))
    CostTable("cpu", "test CPU", "float32", "embedded:tiny-target", torch.__version__, [1, 8, 64], [8],
              {"8": [100.0, 90.0, 40.0]}).save(d / "cost.json")
    shutil.copytree(CKPT, d / "ckpt")
    (d / "tiny.toml").write_text(TINY_RECIPE.format(d=d))
    answer = "The quick brown fox jumps over the lazy dog. " * 2
    (d / "train.jsonl").write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"role": "user", "content": f"Say something {i}"}, {"role": "assistant", "content": answer}]}) + "\n"
        for i in range(2)))
    return d


def _fingerprint(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for root in roots for p in sorted(root.rglob("*"))}


class _Reader(threading.Thread):
    """Reads a file descriptor (or a FIFO, opened here) to its end."""

    def __init__(self, fd: int | None = None, fifo: Path | None = None):
        super().__init__(daemon=True)
        self.fd, self.fifo, self.data = fd, fifo, b""

    def run(self) -> None:
        if self.fifo is not None:
            with open(self.fifo, "rb") as f:
                self.data = f.read()
            return
        with os.fdopen(self.fd, "rb") as f:  # type: ignore[arg-type]
            self.data = f.read()

    def finish(self) -> str:
        for _ in range(300):  # the command may never have opened the FIFO: open it so the reader ends
            if self.fifo is None or not self.is_alive():
                break
            try:
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:  # ENXIO: no reader right now (not yet opened, or closed and ending)
                if exc.errno != errno.ENXIO:
                    raise
            self.join(timeout=0.1)
        self.join(timeout=30)
        return self.data.decode()


def _run(args: list[str], capsys, stdout_pipe: bool) -> tuple[int, str, str]:
    """``dspec ARGS`` in-process: (exit code, stdout, stderr); ``stdout_pipe``: fd 1 is a pipe read
    by another thread while it runs, as in ``dspec ... | cat``."""
    from dspec_cli.cli import main

    reader = saved = None
    if stdout_pipe:
        r, w = os.pipe()
        reader = _Reader(fd=r)
        reader.start()
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(w, 1)
        os.close(w)
        real_stdout, sys.stdout = sys.stdout, io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8")
    try:
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
    finally:
        if stdout_pipe:
            sys.stdout.flush()
            sys.stdout = real_stdout  # type: ignore[possibly-undefined]
            os.dup2(saved, 1)  # type: ignore[arg-type]
            os.close(saved)  # type: ignore[arg-type]
    captured = capsys.readouterr()
    out = reader.finish() if reader is not None else captured.out
    return code, out, captured.err


def _parsed(text: str) -> None:
    """The text is a JSON document or JSON lines (what every file output holds)."""
    assert text.strip(), "empty output"
    try:
        json.loads(text)
    except json.JSONDecodeError:
        for line in text.strip().splitlines():
            json.loads(line)


def _command(out: Output) -> str:
    words = out.command.split()
    return " ".join(words[:2]) if words[0] == "data" else words[0]


@pytest.mark.parametrize(("out", "kind"), ROWS, ids=[f"{_command(o).replace(' ', '-')}{o.option}-{k}" for o, k in ROWS])
def test_output_rule(out, kind, inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = tmp_path / "out"
    t.mkdir()
    path, reader, fd, extra = str(t / ("o" if out.folder else "o.json")), None, None, ""
    if kind == "same-as-input":
        path = str(ASSETS_DIR / "tiny-target") if out.folder else out.reads.format(d=inputs, a=ASSETS_DIR)
    elif kind == "same-as-other-output":
        extra = f" {out.other} {path}"
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
        reader = _Reader(fifo=Path(path))
        reader.start()
    elif kind == "stdout-pipe":
        path = "/dev/stdout"
    elif kind == "dev-fd":
        r, fd = os.pipe()
        reader = _Reader(fd=r)
        reader.start()
        path = f"/dev/fd/{fd}"
    elif kind == "dev-full":
        path = "/dev/full"
    elif kind == "dangling-link":
        os.symlink(t / "made" / ("o" if out.folder else "o.json"), t / "link")
        path = str(t / "link")
    args = (out.command.format(d=inputs, t=t, o=path, a=ASSETS_DIR) + extra).split()
    before = _fingerprint(inputs, ASSETS_DIR)
    try:
        code, stdout, err = _run(args, capsys, stdout_pipe=kind == "stdout-pipe")
    finally:
        if fd is not None:
            os.close(fd)
    got = reader.finish() if reader is not None and kind != "stdout-pipe" else None
    lines = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert "Traceback" not in err, err
    assert _fingerprint(inputs, ASSETS_DIR) == before  # no input changed
    special = kind in ("fifo", "stdout-pipe", "dev-fd", "dev-full")
    if kind in ("same-as-input", "same-as-other-output"):
        assert code == 2 and len(lines) == 1, err
        assert "which this run reads" in lines[0] if kind == "same-as-input" else "same" in lines[0], lines[0]
        assert list(t.iterdir()) == [], "nothing is written"
    elif (out.folder and special) or (not out.folder and kind in ("directory", "dev-full")):
        assert code == 1 and len(lines) == 1, err
        assert lines[0].endswith(("not a folder; give a folder path", "is a folder; give a file path",
                                  "No space left on device")), lines[0]
    else:
        assert code == 0 and not lines, err
        if kind in ("fifo", "dev-fd"):
            _parsed(got or "")
        elif kind == "stdout-pipe":
            _parsed(stdout)
        elif kind == "dangling-link":
            assert os.path.islink(t / "link")
            made = t / "made" / ("o" if out.folder else "o.json")
            assert made.is_dir() if out.folder else (_parsed(made.read_text()) is None)
        elif out.folder:
            assert Path(path).is_dir() and any(Path(path).iterdir())
        else:
            _parsed(Path(path).read_text())
    empty = [p for p in t.rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_size == 0]
    assert empty == [], empty  # no 0-byte output
    leftovers = [p for p in t.rglob(".*")]
    assert leftovers == [], leftovers  # no temporary file or staging folder


# the path options commands read (declared to RunPaths with .read): every other path option is an
# output and has its rows above
INPUT_OPTIONS = {"--cost-table", "--traces", "--calibration", "--recipe", "--init-from"}


def test_every_path_option_is_classified_and_every_output_is_in_the_table():
    """Each command's options that take a path are inputs (INPUT_OPTIONS) or outputs with rows in
    OUTPUTS: a new path option (a new command, a new format) needs one or the other, and its
    declaration in the command's RunPaths."""
    from test_cli_conventions import _commands, _options

    paths = {(c, n) for c, cmd in _commands().items() for n, p in _options(cmd).items()
             if "Path" in str(p.type_descriptor.annotation)}
    covered = {(_command(o), o.option) for o in OUTPUTS}
    assert {(c, n) for c, n in paths if n not in INPUT_OPTIONS} == covered
    assert len(ROWS) >= 180


def test_an_export_folder_holds_one_format_with_one_mode(inputs, tmp_path, capsys):
    """``export --overwrite`` in another format leaves nothing of the earlier one (the folder is
    built beside and swapped in), and every file, weights included, has a new file's mode."""
    from tiny_models import run_cli

    old = os.umask(0o022)
    try:
        out = tmp_path / "e"
        base = ["export", str(inputs / "ckpt"), "--output", str(out), "--cost-table", str(inputs / "cost.json")]
        code, _, err = run_cli([*base, "--format", "sglang"], capsys)
        assert code == 0 and (out / "sglang" / "dspark_sts.json").is_file(), err
        code, _, err = run_cli([*base[:-2], "--format", "vllm", "--overwrite"], capsys)
        assert code == 0, err
        assert sorted(p.name for p in out.iterdir()) == ["SERVE.md", "config.json", "model.safetensors"]
        files = [p for p in out.rglob("*") if p.is_file()]
        assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
        code, _, err = run_cli(["calibrate", "-d", "dspark", "--traces", str(inputs / "traces.jsonl"), "--force",
                                "-o", str(tmp_path / "c")], capsys)
        assert code == 0, err
        assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "c").iterdir()} == {"0o644"}
    finally:
        os.umask(old)


def test_in_place_calibration_writes_into_the_checkpoint_it_reads(inputs, tmp_path, capsys):
    """``calibrate --in-place`` rewrites the calibration.json of the checkpoint it reads (how the
    embedded drafters are calibrated), and a report may go beside the checkpoint's files."""
    from tiny_models import run_cli

    ck = tmp_path / "ck"
    shutil.copytree(inputs / "ckpt", ck)
    code, _, err = run_cli(["calibrate", "-d", "dspark", "--traces", str(inputs / "traces.jsonl"), "--force",
                            "--in-place", "--checkpoint", str(ck), "--json", str(ck / "calibrate.json")], capsys)
    assert code == 0, err
    assert json.loads((ck / "calibration.json").read_text())["drafter"] == "dspark-markov"
    assert json.loads((ck / "calibrate.json").read_text())["rules"]["token"]["num_rounds"] > 0  # traces: no rule recorded
