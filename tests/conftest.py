"""Test-suite settings: tiny models run fastest single-threaded (no oversubscription); Triton
kernels run on CPU tensors in Triton's interpreter."""

import os
import types

import pytest
import torch

torch.set_num_threads(1)

# Triton binds its language to the interpreter when this is set before `import triton`, so it is
# set here, before any test module loads. DSPEC_TEST_DEVICE=cuda runs the kernels compiled.
if os.environ.get("DSPEC_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``engine`` (a real vLLM, minutes each) run only when ``-m`` names them
    (``pytest -m engine``); any other selection, ``-m "not slow"`` included, deselects them."""
    if "engine" in (config.option.markexpr or ""):
        return
    engine = [item for item in items if item.get_closest_marker("engine")]
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [item for item in items if not item.get_closest_marker("engine")]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A saved tiny random Qwen3 target with the ChatML tokenizer (loadable by path)."""
    from tiny_models import tiny_qwen3, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-target")
    tiny_qwen3().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _wide_tables(monkeypatch):
    """Tables on a captured stdout follow COLUMNS (else 80): wide enough that headers stay whole."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running local Hub; huggingface_hub pointed at it with an isolated cache, no token, no Xet."""
    from hub_server import HubServer
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    home = tmp_path / "hf"
    with HubServer() as server:
        for key, value in {"HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        settings = {"HF_HUB_DISABLE_XET": True, "HF_HUB_OFFLINE": False, "HF_HUB_CACHE": str(home / "hub"),
                    "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens")}
        for key, value in settings.items():  # read once at import: patch the module constants
            monkeypatch.setattr(constants, key, value)
        server.sleeps = []  # huggingface_hub's retry back-off, recorded instead of slept
        monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=server.sleeps.append))
        yield server
