"""dspec: speculative decoding drafters for Hugging Face causal LMs."""

from importlib.metadata import PackageNotFoundError, version

import pluggy

try:
    __version__ = version("dspec")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"

hookimpl = pluggy.HookimplMarker("dspec")

__all__ = ["__version__", "hookimpl"]
