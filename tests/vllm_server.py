"""vLLM's CPU build for the engine tests (``pytest -m engine``): its environment and servers
(:mod:`benchmarks.vllm_cpu`), with a failed install skipping the test with its reason (never a
silent pass) and a server that does not come up failing it; and scripts run in the engine
environment (``tests/engine_side``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import vllm_cpu
from benchmarks.vllm_cpu import REPO, engine_env, server_argv

__all__ = ["ENGINE_SIDE", "VllmServer", "run_engine_script", "server_argv", "vllm_env"]

ENGINE_SIDE = Path(__file__).resolve().parent / "engine_side"


def vllm_env() -> Path:
    """The engine environment's folder (``.ci/vllm-env``); skips the calling test if it cannot be made."""
    try:
        return vllm_cpu.vllm_env()
    except vllm_cpu.EngineUnavailable as exc:
        pytest.skip(f"engine environment: {exc}")


def run_engine_script(env_dir: Path, script: str, *args: str, timeout: float = 900, extra: dict | None = None) -> str:
    """Run ``tests/engine_side/<script>`` in the engine environment; its stdout (fails the test on an error)."""
    done = subprocess.run([str(env_dir / "bin" / "python"), str(ENGINE_SIDE / script), *args], capture_output=True,
                          text=True, timeout=timeout, env=engine_env(env_dir, extra), cwd=REPO)
    if done.returncode != 0:
        pytest.fail(f"{script} failed:\n{done.stderr[-3000:]}")
    return done.stdout


class VllmServer(vllm_cpu.VllmServer):
    """:class:`benchmarks.vllm_cpu.VllmServer` that fails the test when vLLM does not come up."""

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except RuntimeError as exc:
            pytest.fail(str(exc))
