"""Output files: atomic replace for regular files and new paths only; devices, FIFOs and symbolic
links are written through, never replaced; output paths are proven writable before any work."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core.errors import DspecError
from dspec_cli.core.outputs import (
    atomic_write_text,
    check_output_dir,
    check_output_file,
    write_json,
)


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "link" if stat.S_ISLNK(mode) else "char" if stat.S_ISCHR(mode) else "fifo" if stat.S_ISFIFO(mode) else (
        "file" if stat.S_ISREG(mode) else "other")


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null")
def test_a_character_device_is_written_through(tmp_path, capsys):
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    for path in ("/dev/null", str(link)):
        code, _, err = run_cli(["drafters", "--json", path], capsys)
        assert code == 0, err
    assert _kind(Path("/dev/null")) == "char" and _kind(link) == "link"
    assert not [p for p in tmp_path.iterdir() if p != link]  # no temporary file left behind


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_failed_write_names_the_path(capsys):
    assert_cli_error(["drafters", "--json", "/dev/full"], capsys, "cannot write /dev/full: No space left on device")
    assert _kind(Path("/dev/full")) == "char"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_is_written_through(tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    check_output_file(fifo, "--json")
    write_json(fifo, {"a": 1})
    reader.join(timeout=10)
    assert json.loads(got[0]) == {"a": 1} and _kind(fifo) == "fifo"


def test_a_symbolic_link_keeps_pointing_at_its_file(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_text(link, "new\n")
    assert _kind(link) == "link" and real.read_text() == "new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "sub" / "made.json")
    check_output_file(dangling, "--json")
    atomic_write_text(dangling, "x\n")
    assert _kind(dangling) == "link" and (tmp_path / "sub" / "made.json").read_text() == "x\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "real.json", "sub"]


def test_other_special_files_are_refused(tmp_path):
    import socket

    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(DspecError, match="is a socket; give a file path"):
            check_output_file(path, "--json")


def test_writability_is_proven_not_read_from_permission_bits(tmp_path):
    """A folder that cannot take a file (here /proc, which refuses even root) fails at the check."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc")
    with pytest.raises(DspecError, match=r"--json /proc/no/such/b.json: cannot write in /proc"):
        check_output_file("/proc/no/such/b.json", "--json")
    with pytest.raises(DspecError, match="cannot write in /proc"):
        check_output_dir("/proc/no/plots", "--plots")
    check_output_file(tmp_path / "a" / "b" / "c.json", "--json")
    check_output_dir(tmp_path / "d", "--plots")
    assert list(tmp_path.iterdir()) == []  # the probes leave nothing behind


def test_a_folder_with_files_needs_overwrite(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(DspecError, match="folder is not empty; pass --overwrite"):
        check_output_dir(tmp_path, "--output", overwrite=False)
    check_output_dir(tmp_path, "--output")
    check_output_dir(tmp_path / "new", "--output", overwrite=False)


def test_the_rule_compares_what_a_run_reads_and_writes(tmp_path):
    """Identity by inode or real path; a checkpoint folder is read by name (a report beside its
    files is fine); /dev/null takes any number of outputs; locks end with release()."""
    from dspec_cli.core.files import CHECKPOINT_READS
    from dspec_cli.core.run_paths import PathConflict, RunPaths

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    os.link(data, tmp_path / "same.jsonl")
    (tmp_path / "link").symlink_to(ck / "config.json")

    def paths() -> RunPaths:
        return RunPaths().read("--checkpoint", ck, names=CHECKPOINT_READS).read("--dataset", data)

    paths().write("--json", ck / "bench.json").write_folder("--plots", ck, files=("a.png",)).check().release()
    paths().write("--json", "/dev/null").write("--save-traces", "/dev/null").check().release()
    for out, match in [(ck / "config.json", "is config.json of --checkpoint"), (tmp_path / "link", "config.json of"),
                       (tmp_path / "same.jsonl", "is --dataset"), (ck / "model.safetensors", "model.safetensors of")]:
        with pytest.raises(PathConflict, match=match):
            paths().write("--json", out).check()
    with pytest.raises(PathConflict, match="holds --checkpoint"):
        paths().write_folder("--output", tmp_path).check()
    with pytest.raises(PathConflict, match="both write to stdout"):
        RunPaths().write("--json", "-", stream=True).write("--save-traces", "/dev/stdout", stream=True).check()


def test_descriptor_paths_are_written_through(tmp_path):
    from dspec_cli.core.outputs import is_special, is_stdout, through_descriptor

    link = tmp_path / "out"
    link.symlink_to("/dev/stdout")
    assert through_descriptor("/dev/stdout") and through_descriptor(link) and through_descriptor("/proc/self/fd/1")
    assert not through_descriptor(tmp_path / "plain.json") and not through_descriptor("/dev/null")
    assert is_stdout("-") and not is_stdout(tmp_path / "plain.json")
    r, w = os.pipe()
    try:
        assert is_special(f"/dev/fd/{w}") and not is_stdout(f"/dev/fd/{w}")
    finally:
        os.close(r)
        os.close(w)
