"""dspec: speculative decoding drafters for Hugging Face causal LMs.

The plugin-author API is re-exported here (docs/plugins.md lists every name): a plugin imports
``dspec_cli`` (and the model building blocks in :mod:`dspec_cli.nn`) and nothing else of the
package. Names load on first use, so ``import dspec_cli`` stays cheap for the CLI (the runtime
pulls in torch and transformers); type checkers and IDEs read the same names from the imports
under ``TYPE_CHECKING`` (tests/test_api.py keeps the two lists equal).
"""

from importlib import import_module
from typing import TYPE_CHECKING

from dspec_cli.core.hookspecs import hookimpl
from dspec_cli.core.version import __version__

if TYPE_CHECKING:
    from dspec_cli.checkpoints.layouts import Converted
    from dspec_cli.core.calibration import Calibration
    from dspec_cli.core.errors import DspecError
    from dspec_cli.core.files import embedded_path
    from dspec_cli.core.hardware import CostTable
    from dspec_cli.core.plugins import get_drafter_class, get_scheduler_class, registry
    from dspec_cli.core.types import (
        PAD,
        Capability,
        DraftTree,
        PrefillOutput,
        Proposal,
        Sampler,
        StepOutput,
        VerifyResult,
    )
    from dspec_cli.runtime.drafter import (
        Drafter,
        DrafterConfig,
        DraftState,
        TrainableDrafter,
        WrappedDrafter,
        heuristic_confidence,
    )
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
    from dspec_cli.runtime.schedule import Scheduler
    from dspec_cli.runtime.target import Target, TargetBatch
    from dspec_cli.runtime.tree_select import best_path, select_tree
    from dspec_cli.runtime.verify import verify_chain, verify_greedy, verify_tree
    from dspec_cli.training.data import TrainData

_API = {
    # core: errors, the round's data types, the registry
    "DspecError": "dspec_cli.core.errors",
    "Capability": "dspec_cli.core.types",
    "DraftTree": "dspec_cli.core.types",
    "PAD": "dspec_cli.core.types",
    "PrefillOutput": "dspec_cli.core.types",
    "Proposal": "dspec_cli.core.types",
    "Sampler": "dspec_cli.core.types",
    "StepOutput": "dspec_cli.core.types",
    "VerifyResult": "dspec_cli.core.types",
    "Calibration": "dspec_cli.core.calibration",
    "CostTable": "dspec_cli.core.hardware",
    "embedded_path": "dspec_cli.core.files",
    "get_drafter_class": "dspec_cli.core.plugins",
    "get_scheduler_class": "dspec_cli.core.plugins",
    "registry": "dspec_cli.core.plugins",
    # checkpoints: what a foreign layout's reader returns
    "Converted": "dspec_cli.checkpoints.layouts",
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
    "Target": "dspec_cli.runtime.target",
    "TargetBatch": "dspec_cli.runtime.target",
    "GenerationConfig": "dspec_cli.runtime.engine",
    "SpeculativeEngine": "dspec_cli.runtime.engine",
    "verify_chain": "dspec_cli.runtime.verify",
    "verify_greedy": "dspec_cli.runtime.verify",
    "verify_tree": "dspec_cli.runtime.verify",
    # training: what TrainableDrafter.prepare_training receives
    "TrainData": "dspec_cli.training.data",
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
