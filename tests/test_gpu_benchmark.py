"""The GPU benchmark's budget: parts run most valuable first within what the budget has left, the
report is written after every part, a stopped or failed part keeps what it measured and the
tail of its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.budget import MARGIN, Outcome, Part, launch, run_parts

ROOT = Path(__file__).resolve().parents[1]


def test_parts_run_in_order_within_the_budget_and_the_report_follows_each_part():
    clock = [0.0]
    asked: list[tuple[str, float]] = []
    updates: list[list[str]] = []

    def run(part: Part, seconds: float) -> Outcome:
        asked.append((part.name, seconds))
        clock[0] += {"a": 30, "b": 50, "c": 5}[part.name]  # b runs out of time, keeping what it measured
        if part.name == "b":
            return Outcome({"rows": [1]}, "stopped after 50 s", ["Traceback ...", "KeyboardInterrupt"])
        return Outcome({"ok": part.name})

    parts = [Part("a", 40), Part("b", 50), Part("c", 60, least=10), Part("d", 60, least=15)]
    report = run_parts(parts, 100, run, lambda r: updates.append(sorted(r)), clock=lambda: clock[0])
    assert asked == [("a", 40), ("b", 50), ("c", 100 - 80 - MARGIN)]  # each within its cap and what is left
    assert report["a"] == {"ok": "a"} and report["b"] == {"rows": [1]} and report["c"] == {"ok": "c"}
    assert report["errors"] == {"b": {"error": "stopped after 50 s", "tail": ["Traceback ...", "KeyboardInterrupt"]}}
    assert report["skipped"] == ["d"] and report["seconds"] == {"a": 30, "b": 50, "c": 5}
    assert len(updates) == 4 and "a" in updates[0]  # the report after every part


def _child(tmp_path: Path, body: str) -> list[str]:
    out = tmp_path / "part.json"
    script = f"import json, sys, time\nout = {str(out)!r}\n{body}"
    return [sys.executable, "-c", script], out


def test_a_stopped_part_keeps_its_partial_results_and_a_failed_one_its_traceback(tmp_path):
    cmd, out = _child(tmp_path, "json.dump({'rows': [1, 2]}, open(out, 'w'))\nprint('measuring', flush=True)\n"
                                "time.sleep(60)")
    stopped = launch(cmd, out, timeout=3)
    assert stopped.result == {"rows": [1, 2]} and stopped.error == "stopped after 3 s"
    assert stopped.tail == ["measuring"]
    out.unlink()
    cmd, out = _child(tmp_path, "raise RuntimeError('CUDA error: an illegal memory access')")
    failed = launch(cmd, out, timeout=30)
    assert failed.result is None and failed.error == "exit status 1"
    assert failed.tail[0].startswith("Traceback") and "illegal memory access" in failed.tail[-1]


@pytest.mark.slow
def test_a_cpu_dry_run_finishes_inside_its_budget(tmp_path):
    """``--budget`` on a CPU with the toy target: two parts in their own processes, the JSON with
    their results, the machine and the goals; the run ends within the budget."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--json", str(out), "--budget", "90", "--device", "cpu", "--small",
           "--parts", "bandwidth,kernels"]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=100, capture_output=True)
    report = json.loads(out.read_text())
    assert not report["errors"] and not report["skipped"] and report["machine"]["device"] == "cpu"
    assert report["kernels"]["runs"][0]["torch_block-logits_ms"] > 0 and sum(report["seconds"].values()) < 90
    assert "verify block-logits R=1 vs reading its input" in report["goals"]
