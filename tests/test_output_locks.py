"""Two runs that write the same path at once: the second is refused in one line naming the first
(its pid and command line), before it loads anything, and changes nothing.

Per command, a first run starts in its own process (forked from this one, so it starts at once)
and stops right after its output paths are checked and locked (``RunPaths.check``), standing for a
run at work; the same command line then runs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_output_rule import CKPT, TINY_RECIPE

from dspec_cli.core.hardware import CostTable

# command line ({d}: inputs, {t}: the shared outputs) and the output the second run is refused for
COMMANDS = {
    "bench": ("bench -d prompt-lookup --num-prompts 1 --dataset {d}/good.jsonl --json {t}/b.json", "--json"),
    "calibrate": ("calibrate -d dspark --traces {d}/traces.jsonl --force -o {t}/cal", "--output"),
    "data regenerate": ("data regenerate --dataset {d}/good.jsonl -o {t}/r.jsonl", "--output"),
    "train": ("train --recipe {d}/tiny.toml -o {t}/run", "--output"),
    "profile-hardware": ("profile-hardware --grid 1 --contexts 8 --repeats 1 --json {t}/cost.json", "--json"),
    "schedule": ("schedule --cost-table {d}/cost.json --traces {d}/traces.jsonl --plots {t}/plots", "--plots"),
    "export": ("export {d}/ckpt --format vllm --output {t}/e", "--output"),
    "push": ("push {d}/ckpt --repo-id alice/x --dry-run --json {t}/p.json", "--json"),
    "drafters": ("drafters --json {t}/d.json", "--json"),
    "datasets": ("datasets --json {t}/s.json", "--json"),
}


class FirstRun:
    """``dspec ARGS`` in a forked process that holds its locks until :meth:`finish`."""

    def __init__(self, args: list[str]):
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the first run
            os.close(ready_r)
            os.close(go_w)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            from dspec_cli.cli import main
            from dspec_cli.core import run_paths

            check = run_paths.RunPaths.check

            def held(self):
                check(self)
                os.write(ready_w, b"locked")
                os.read(go_r, 1)  # until the test has run the second one
                os._exit(0)

            run_paths.RunPaths.check = held
            sys.argv = ["dspec", *args]
            try:
                main(args)
            finally:
                os._exit(3)  # never got to the check
        os.close(ready_w)
        os.close(go_r)
        self.ready, self.go = ready_r, go_w

    def locked(self) -> bool:
        return os.read(self.ready, 16) == b"locked"

    def finish(self) -> int:
        os.write(self.go, b"x")
        os.close(self.go)
        os.close(self.ready)
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory):
    d, t = tmp_path_factory.mktemp("inputs"), tmp_path_factory.mktemp("shared")
    (d / "good.jsonl").write_text('{"turns": ["Hello there"]}\n')
    (d / "traces.jsonl").write_text("".join(json.dumps({"drafter": "dspark-markov", "block_size": 7,
                                                        "confidence": [0.9] * 7, "accepted": a}) + "\n"
                                            for a in range(8)))
    CostTable("cpu", "test CPU", "float32", "embedded:tiny-target", torch.__version__, [1, 8], [8],
              {"8": [100.0, 90.0]}).save(d / "cost.json")
    shutil.copytree(CKPT, d / "ckpt")
    (d / "tiny.toml").write_text(TINY_RECIPE.format(d=d))
    (d / "train.jsonl").write_text(json.dumps({"id": "0", "conversations": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello to you too, friend."}]}) + "\n")
    import dspec_cli.training.loop  # noqa: F401  (the commands' modules, imported before the forks)
    import dspec_cli.training.regenerate  # noqa: F401
    import dspec_cli.workflows.bench  # noqa: F401
    import dspec_cli.workflows.calibrate_run  # noqa: F401
    import dspec_cli.workflows.export  # noqa: F401
    import dspec_cli.workflows.validate  # noqa: F401

    cwd = os.getcwd()
    os.chdir(t)
    try:
        runs = {name: FirstRun(args.format(d=d, t=t).split()) for name, (args, _) in COMMANDS.items()}
    finally:
        os.chdir(cwd)
    yield d, t, runs
    for run in runs.values():
        with contextlib.suppress(OSError, ChildProcessError):
            run.finish()


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_second_run_writing_the_same_path_is_refused(name, first_runs, capsys, monkeypatch):
    from tiny_models import run_cli

    from dspec_cli.runtime.target import Target

    d, t, runs = first_runs
    first = runs[name]
    assert first.locked(), "the first run did not reach its output check"
    monkeypatch.setattr(Target, "load", lambda *a, **k: pytest.fail("the second run loaded a model"))
    monkeypatch.chdir(t)
    before = _snapshot(t)
    args, option = COMMANDS[name]
    code, _, err = run_cli(args.format(d=d, t=t).split(), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f"Error: {option} " in lines[0] and f"another dspec run is writing it (pid {first.pid}: dspec {name}" in lines[0]
    assert _snapshot(t) == before  # the second run changed nothing
    assert first.finish() == 0


def test_a_lock_ends_with_its_run(tmp_path, capsys):
    """After a run, the next one to the same path goes ahead (in this process too)."""
    from tiny_models import run_cli

    for _ in range(2):
        code, _, err = run_cli(["drafters", "--json", str(tmp_path / "d.json")], capsys)
        assert code == 0, err


def test_a_hard_link_is_the_same_file(tmp_path, capsys):
    """Locks key outputs by real path and by inode: a run writing through a hard link is refused
    while another writes the file itself."""
    from tiny_models import run_cli

    from dspec_cli.core.run_paths import RunPaths

    (tmp_path / "a.json").write_text("{}")
    os.link(tmp_path / "a.json", tmp_path / "b.json")
    held = RunPaths().write("--json", tmp_path / "a.json").check()
    try:
        code, _, err = run_cli(["drafters", "--json", str(tmp_path / "b.json")], capsys)
        assert code == 1 and "another dspec run is writing it" in err, err
    finally:
        held.release()
    assert run_cli(["drafters", "--json", str(tmp_path / "b.json")], capsys)[0] == 0
