"""Two runs that write the same path at once: the second is refused in one line naming the first
(its pid and command line), before it loads anything, and changes nothing.

Per command, a first run starts in its own process and stops right after its output paths are
checked and locked (``RunPaths.check``), standing for a run at work; the same command line then
runs here. The first runs start together (one process each) so the table takes one start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_output_rule import CKPT, TINY_RECIPE

from dspec_cli.core.hardware import CostTable

REPO = Path(__file__).resolve().parents[1]
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
HOLD = """
import sys
from dspec_cli.core import run_paths
check = run_paths.RunPaths.check
def held(self):
    check(self)
    print("locked", flush=True)
    sys.stdin.readline()  # until the test has run the second one
    raise SystemExit(0)
run_paths.RunPaths.check = held
from dspec_cli.cli import main
main(sys.argv[1:])
"""


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-c", HOLD, *args.format(d=d, t=t).split()], cwd=t, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in COMMANDS.items()}
    yield d, t, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_second_run_writing_the_same_path_is_refused(name, first_runs, capsys, monkeypatch):
    from tiny_models import run_cli

    from dspec_cli.runtime.target import Target

    d, t, procs = first_runs
    first = procs[name]
    line = first.stdout.readline()  # type: ignore[union-attr]
    assert line.strip() == "locked", first.stderr.read() if first.poll() is not None else line  # type: ignore[union-attr]
    monkeypatch.setattr(Target, "load", lambda *a, **k: pytest.fail("the second run loaded a model"))
    monkeypatch.chdir(t)
    before = _snapshot(t)
    args, option = COMMANDS[name]
    code, _, err = run_cli(args.format(d=d, t=t).split(), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f"Error: {option} " in lines[0] and f"another dspec run is writing it (pid {first.pid}: " in lines[0], lines[0]
    assert name.split()[0] in lines[0]  # the first run's command line
    assert _snapshot(t) == before  # the second run changed nothing
    first.communicate("\n", timeout=60)
    assert first.returncode == 0


def test_a_lock_ends_with_its_run(tmp_path, capsys):
    """After a run, the next one to the same path goes ahead (in this process too)."""
    from tiny_models import run_cli

    for _ in range(2):
        code, _, err = run_cli(["drafters", "--json", str(tmp_path / "d.json")], capsys)
        assert code == 0, err
