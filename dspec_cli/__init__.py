"""dspec: speculative decoding drafters for Hugging Face causal LMs.

The plugin-author API is re-exported here: a plugin imports ``dspec_cli`` (and the model
building blocks in :mod:`dspec_cli.nn`) and nothing else of the package. Names load on first
use, so ``import dspec_cli`` stays cheap for the CLI (the runtime pulls in torch and
transformers).
"""

from importlib import import_module

from dspec_cli.core.hookspecs import hookimpl
from dspec_cli.core.version import __version__

_API = {
    # core: errors, the round's data types, the registry
    "DspecError": "dspec_cli.core.errors",
    "Capability": "dspec_cli.core.types",
    "DraftTree": "dspec_cli.core.types",
    "Proposal": "dspec_cli.core.types",
    "Sampler": "dspec_cli.core.types",
    "StepOutput": "dspec_cli.core.types",
    "VerifyResult": "dspec_cli.core.types",
    "Calibration": "dspec_cli.core.calibration",
    "CostTable": "dspec_cli.core.hardware",
    "Converted": "dspec_cli.checkpoints.layouts",
    "embedded_path": "dspec_cli.core.files",
    "get_drafter_class": "dspec_cli.core.plugins",
    "get_scheduler_class": "dspec_cli.core.plugins",
    "registry": "dspec_cli.core.plugins",
    # runtime: what a drafter or scheduler builds on
    "Drafter": "dspec_cli.runtime.drafter",
    "DrafterConfig": "dspec_cli.runtime.drafter",
    "DraftState": "dspec_cli.runtime.drafter",
    "TrainableDrafter": "dspec_cli.runtime.drafter",
    "WrappedDrafter": "dspec_cli.runtime.drafter",
    "heuristic_confidence": "dspec_cli.runtime.drafter",
    "best_path": "dspec_cli.runtime.tree_select",
    "select_tree": "dspec_cli.runtime.tree_select",
    "Scheduler": "dspec_cli.runtime.schedule",
    "admit_candidates": "dspec_cli.runtime.schedule",
    "Target": "dspec_cli.runtime.target",
    "TargetBatch": "dspec_cli.runtime.target",
    "GenerationConfig": "dspec_cli.runtime.engine",
    "SpeculativeEngine": "dspec_cli.runtime.engine",
    "verify_chain": "dspec_cli.runtime.verify",
    "verify_greedy": "dspec_cli.runtime.verify",
    "verify_tree": "dspec_cli.runtime.verify",
}

__all__ = ["__version__", "hookimpl", *_API]


def __getattr__(name: str):
    """PEP 562: resolve an API name from its module on first access (keeps the CLI start fast)."""
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'dspec_cli' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
