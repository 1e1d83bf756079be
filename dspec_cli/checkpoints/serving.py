"""Which serving engine loads a drafter: the foreign layout dspec writes it in (:mod:`layouts`) and
the method each engine serves that layout with (docs/interop.md lists the upstream sources).

| layout written | vLLM ``method`` | SGLang ``--speculative-algorithm`` |
|---|---|---|
| ``Qwen3DSparkModel`` / ``Gemma4DSparkModel`` (DeepSpec) | ``dspark`` | ``DSPARK`` |
| ``DFlashDraftModel`` (z-lab) | ``dflash`` | ``DFLASH`` |
| ``LlamaForCausalLMEagle3`` (SpecForge) | ``eagle3`` | ``EAGLE3`` |

A layout can hold a variant an engine has no method for: DeepSpec's DFlash (no Markov head),
the RNN head on vLLM, a DSpark drafter without a confidence head on SGLang.
:func:`serving_methods` answers both questions for ``dspec train`` (before step 1) and
``dspec export``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspec_cli.checkpoints.layouts import to_foreign
from dspec_cli.core.errors import DspecError

if TYPE_CHECKING:  # annotations only: checkpoints/ sits below runtime/
    from dspec_cli.runtime.target import Target

FORMATS = ("vllm", "sglang")
ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
METHODS = {  # layout -> (vLLM method, SGLang algorithm)
    "Qwen3DSparkModel": ("dspark", "DSPARK"),
    "Gemma4DSparkModel": ("dspark", "DSPARK"),  # vLLM infers dspark from this architecture too
    "DFlashDraftModel": ("dflash", "DFLASH"),
    "LlamaForCausalLMEagle3": ("eagle3", "EAGLE3"),
}
DSPARK_LAYOUTS = ("Qwen3DSparkModel", "Gemma4DSparkModel")


def method(layout: str, fmt: str) -> str:
    """The engine's method (vLLM) or algorithm (SGLang) for ``layout``."""
    return METHODS[layout][FORMATS.index(fmt)]


def check_engine_support(layout: str, config: dict, fmt: str) -> None:
    """DspecError when the engine ``fmt`` has no method for this foreign checkpoint."""
    if layout not in DSPARK_LAYOUTS:
        return
    if not config["markov_rank"]:
        raise DspecError(
            "dflash in DeepSpec's block layout (the anchor slot predicts) has no vLLM/SGLang method: their dflash "
            "expects z-lab's layout (anchor_predicts = false) and their dspark needs a Markov head"
        )
    if fmt == "vllm" and config.get("markov_head_type") != "vanilla":
        raise DspecError("vLLM's DSpark (qwen3_dspark.py) serves the vanilla Markov head only, not "
                         f"{config['markov_head_type']!r} (SGLang's serves it: --format sglang)")
    if fmt == "sglang" and not config.get("enable_confidence_head"):
        raise DspecError("SGLang's DSpark compact verification (SGLANG_RAGGED_VERIFY_MODE=compact) needs a trained "
                         "confidence head and this drafter has none (train with confidence_head = true)")


def serving_methods(drafter, target: Target) -> tuple[dict[str, str], dict[str, str]]:
    """({format: method} of the engines that serve ``drafter``, {format: why not} of the others)."""
    try:
        layout, config, _ = to_foreign(drafter, target)
    except DspecError as exc:
        return {}, dict.fromkeys(FORMATS, str(exc))
    served, refused = {}, {}
    for fmt in FORMATS:
        try:
            check_engine_support(layout, config, fmt)
            served[fmt] = method(layout, fmt)
        except DspecError as exc:
            refused[fmt] = str(exc)
    return served, refused


def describe(served: dict[str, str], refused: dict[str, str]) -> str:
    """One line for ``dspec train``: which engines serve the result, and why the others do not."""
    if not served:
        reason = next(iter(refused.values()), "")
        return f"no serving engine loads this drafter ({reason}); `dspec export` will refuse it"
    text = "servable after training by " + ", ".join(f"{ENGINES[f]} ({m})" for f, m in served.items())
    return text + "".join(f"; not by {ENGINES[f]}: {why}" for f, why in refused.items())
