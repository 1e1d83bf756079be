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

if TYPE_CHECKING:  # explicit re-exports (``X as X``) of the names _API loads lazily
    from dspec_cli.checkpoints.config import DrafterConfig as DrafterConfig
    from dspec_cli.checkpoints.layouts import Converted as Converted
    from dspec_cli.core.calibration import Calibration as Calibration
    from dspec_cli.core.errors import DspecError as DspecError
    from dspec_cli.core.files import embedded_path as embedded_path
    from dspec_cli.core.hardware import CostTable as CostTable
    from dspec_cli.core.host import reads_free as reads_free
    from dspec_cli.core.plugins import get_drafter_class as get_drafter_class
    from dspec_cli.core.plugins import get_scheduler_class as get_scheduler_class
    from dspec_cli.core.plugins import registry as registry
    from dspec_cli.core.types import PAD as PAD
    from dspec_cli.core.types import Capability as Capability
    from dspec_cli.core.types import DraftTree as DraftTree
    from dspec_cli.core.types import PrefillOutput as PrefillOutput
    from dspec_cli.core.types import Proposal as Proposal
    from dspec_cli.core.types import Sampler as Sampler
    from dspec_cli.core.types import VerifyResult as VerifyResult
    from dspec_cli.runtime.drafter import Drafter as Drafter
    from dspec_cli.runtime.drafter import DraftState as DraftState
    from dspec_cli.runtime.drafter import TrainableDrafter as TrainableDrafter
    from dspec_cli.runtime.drafter import WrappedDrafter as WrappedDrafter
    from dspec_cli.runtime.drafter import heuristic_confidence as heuristic_confidence
    from dspec_cli.runtime.engine import GenerationConfig as GenerationConfig
    from dspec_cli.runtime.engine import SpeculativeEngine as SpeculativeEngine
    from dspec_cli.runtime.schedule import Scheduler as Scheduler
    from dspec_cli.runtime.schedule import admit_candidates as admit_candidates
    from dspec_cli.runtime.target import Target as Target
    from dspec_cli.runtime.target import TargetBatch as TargetBatch
    from dspec_cli.runtime.tree_select import best_path as best_path
    from dspec_cli.runtime.tree_select import select_tree as select_tree
    from dspec_cli.runtime.verify import verify_chain as verify_chain
    from dspec_cli.runtime.verify import verify_greedy as verify_greedy
    from dspec_cli.runtime.verify import verify_tree as verify_tree
    from dspec_cli.training.data import TrainData as TrainData

_API = {
    # core: errors, the round's data types, the registry
    "DspecError": "dspec_cli.core.errors",
    "Capability": "dspec_cli.core.types",
    "DraftTree": "dspec_cli.core.types",
    "PAD": "dspec_cli.core.types",
    "PrefillOutput": "dspec_cli.core.types",
    "Proposal": "dspec_cli.core.types",
    "Sampler": "dspec_cli.core.types",
    "VerifyResult": "dspec_cli.core.types",
    "Calibration": "dspec_cli.core.calibration",
    "CostTable": "dspec_cli.core.hardware",
    "embedded_path": "dspec_cli.core.files",
    "reads_free": "dspec_cli.core.host",
    "get_drafter_class": "dspec_cli.core.plugins",
    "get_scheduler_class": "dspec_cli.core.plugins",
    "registry": "dspec_cli.core.plugins",
    # checkpoints: a drafter's config.json hyper-parameters, what a foreign layout's reader returns
    "DrafterConfig": "dspec_cli.checkpoints.config",
    "Converted": "dspec_cli.checkpoints.layouts",
    # runtime: what a drafter or scheduler builds on
    "Drafter": "dspec_cli.runtime.drafter",
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
    # training: what TrainableDrafter.prepare_training receives
    "TrainData": "dspec_cli.training.data",
}

__all__ = [  # the names of _API and the two defined here, spelled out for type checkers (tests/test_api.py)
    "__version__", "hookimpl", "DspecError", "Capability", "DraftTree", "PAD", "PrefillOutput", "Proposal",
    "Sampler", "VerifyResult", "Calibration", "CostTable", "embedded_path", "reads_free", "get_drafter_class",
    "get_scheduler_class", "registry", "DrafterConfig", "Converted", "Drafter", "DraftState",
    "TrainableDrafter", "WrappedDrafter", "heuristic_confidence", "best_path", "select_tree", "Scheduler",
    "admit_candidates", "Target", "TargetBatch", "GenerationConfig", "SpeculativeEngine", "verify_chain", "verify_greedy",
    "verify_tree", "TrainData",
]


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
