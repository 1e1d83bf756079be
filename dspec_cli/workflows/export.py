"""Export for serving engines: the draft folder vLLM / SGLang read, and the serve command.

Layouts and engine methods (docs/interop.md lists the upstream sources):

| drafter | layout written | vLLM ``method`` | SGLang ``--speculative-algorithm`` |
|---|---|---|---|
| dspark-markov | ``Qwen3DSparkModel`` / ``Gemma4DSparkModel`` (DeepSpec) | ``dspark`` | ``DSPARK`` |
| dflash, anchor_predicts = false | ``DFlashDraftModel`` (z-lab) | ``dflash`` | ``DFLASH`` |
| eagle3, qk_norm = false, 3 taps | ``LlamaForCausalLMEagle3`` | ``eagle3`` | ``EAGLE3`` |

Refused in one line: DeepSpec-layout ``dflash`` (the engines' dflash expects z-lab's block
layout and their dspark a Markov head), ``dspark-rnn`` (the engines' DSpark has the vanilla
Markov head only), and drafters without a foreign layout.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dspec_cli.checkpoints.layouts import save, to_foreign
from dspec_cli.core.errors import DspecError

FORMATS = ("vllm", "sglang")
METHODS = {  # layout -> (vLLM method, SGLang algorithm)
    "Qwen3DSparkModel": ("dspark", "DSPARK"),
    "Gemma4DSparkModel": ("dspark", "DSPARK"),  # vLLM infers dspark from this architecture too
    "DFlashDraftModel": ("dflash", "DFLASH"),
    "LlamaForCausalLMEagle3": ("eagle3", "EAGLE3"),
}


def check_engine_support(layout: str, config: dict) -> None:
    """DspecError when vLLM / SGLang have no method for this foreign checkpoint."""
    if layout not in ("Qwen3DSparkModel", "Gemma4DSparkModel"):
        return
    if not config["markov_rank"]:
        raise DspecError(
            "dflash in DeepSpec's block layout (the anchor slot predicts) has no vLLM/SGLang method: their dflash "
            "expects z-lab's layout (anchor_predicts = false) and their dspark needs a Markov head"
        )
    if config.get("markov_head_type") != "vanilla":
        raise DspecError(f"vLLM/SGLang DSpark serve the vanilla Markov head only, not {config['markov_head_type']!r}")


def serve_command(fmt: str, layout: str, drafter, model: str, target: str) -> dict:
    """The engine's settings for this draft folder and the shell command that starts the server."""
    vllm_method, sglang_algorithm = METHODS[layout]
    cfg = drafter.config
    if fmt == "vllm":
        spec = {"method": vllm_method, "model": model, "num_speculative_tokens": cfg.block_size}
        command = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"
        return {"speculative_config": spec, "command": command}
    args = ["--model-path", target, "--speculative-algorithm", sglang_algorithm,
            "--speculative-draft-model-path", model]
    if layout in ("Qwen3DSparkModel", "Gemma4DSparkModel"):
        args += ["--speculative-dspark-block-size", str(cfg.block_size)]
    elif layout == "DFlashDraftModel":
        args += ["--speculative-num-draft-tokens", str(cfg.block_size + 1)]  # the block, anchor included
    elif cfg.tree:
        args += ["--speculative-num-steps", str(cfg.tree_depth), "--speculative-eagle-topk", str(cfg.tree_top_k),
                 "--speculative-num-draft-tokens", str(cfg.tree_total_tokens)]
    else:
        args += ["--speculative-num-steps", str(cfg.block_size), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(cfg.block_size + 1)]
    command = " ".join(["python -m sglang.launch_server", *map(shlex.quote, args)])
    return {"args": args, "command": command}


def export(drafter, target, fmt: str, output: Path, target_name: str) -> dict:
    """Write ``drafter`` into ``output`` in the layout the engine reads; returns the report
    (format, drafter, layout, method, output, target, the engine settings and the command)."""
    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    layout, config, tensors = to_foreign(drafter, target)
    check_engine_support(layout, config)
    save(output, config, tensors)
    method = METHODS[layout][0 if fmt == "vllm" else 1]
    report = {"format": fmt, "drafter": drafter.name, "layout": layout, "method": method,
              "output": str(output.resolve()), "target": target_name}
    return {**report, **serve_command(fmt, layout, drafter, report["output"], target_name)}
