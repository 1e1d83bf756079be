"""How dspec talks to the Hugging Face Hub, shared by checkpoints and prompt sets: the endpoint
(``HF_ENDPOINT`` read at call time) and a finite default timeout for huggingface_hub's client."""

from __future__ import annotations

import os

_timeouts_bounded = False  # set once bound_timeouts has installed its client factory


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """The explicit endpoint, else ``HF_ENDPOINT`` as set now (None: huggingface_hub's default)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def bound_timeouts() -> None:
    """Give huggingface_hub's shared HTTP client a finite default timeout (its own is none)."""
    global _timeouts_bounded
    if _timeouts_bounded:
        return
    from huggingface_hub.utils import set_client_factory

    try:
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # another huggingface_hub layout: keep its defaults
        return

    def factory():
        client = default_client_factory()
        client.timeout = float(os.environ.get("DSPEC_HUB_TIMEOUT", "60"))
        return client

    set_client_factory(factory)
    _timeouts_bounded = True
