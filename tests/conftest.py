"""Test-suite settings: tiny models run fastest single-threaded (no oversubscription)."""

import pytest
import torch

torch.set_num_threads(1)


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
