"""Export for serving engines: the draft folder vLLM / SGLang read, and the serve command.

The layout each drafter is written in and the engines' methods for it are
:mod:`dspec_cli.checkpoints.serving`'s (docs/interop.md lists the upstream sources);
``--format speculators`` writes vllm-project/speculators' format instead (the ``speculators``
family of :mod:`dspec_cli.checkpoints.layouts`), which speculators loads and fine-tunes and vLLM
serves. DSpark on
SGLang runs with ``SGLANG_RAGGED_VERIFY_MODE=compact`` (confidence-scheduled verification) and
gets the STS / SPS side files of :mod:`~dspec_cli.workflows.serve_files`; on vLLM with
``enable_adaptive_verification`` when the drafter has a confidence head. A drafter no engine
serves is refused in one line before anything is written.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspec_cli.checkpoints.layouts import save, to_foreign
from dspec_cli.checkpoints.serving import (
    DSPARK_LAYOUTS,
    METHODS,
    check_engine_support,
    method,
)
from dspec_cli.checkpoints.serving import FORMATS as ENGINE_FORMATS
from dspec_cli.core.chat_template import DEFAULT_KWARGS, describe
from dspec_cli.core.errors import DspecError
from dspec_cli.core.outputs import atomic_write_text, replace_folder
from dspec_cli.runtime.drafter import warn_if_other_kwargs
from dspec_cli.workflows.serve_files import (
    SERVE_FILE,
    Sidecars,
    serve_markdown,
    sglang_sidecars,
)

SGLANG_ENV = {"SGLANG_RAGGED_VERIFY_MODE": "compact"}  # DSpark's confidence-scheduled (trimmed) verification
SPECULATORS = "speculators"
FORMATS = (*ENGINE_FORMATS, SPECULATORS)
SPECULATORS_NOTE = ("speculators loads this folder with `SpeculatorModel.from_pretrained` (and fine-tunes it); "
                    "vLLM reads the method, γ and the target from its config.json")


def speculators_command(config: dict, model: str, target: str, template: list[str]) -> dict:
    """vLLM serving a speculators-format folder: the target with the folder as its speculative model."""
    tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    spec = {"model": model, "num_speculative_tokens": tokens}
    command = " ".join(["vllm serve", shlex.quote(target), "--speculative-config", shlex.quote(json.dumps(spec)),
                        *map(shlex.quote, template)])
    return {"speculative_config": spec, "command": command}


def serve_command(fmt: str, layout: str, drafter, model: str, target: str, files: dict | None = None,
                  chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> dict:
    """The engine's settings for this draft folder and the shell command that starts the server;
    ``files``: SGLang's side files ({"sts", "sps"} -> path) to pass. Non-empty
    ``chat_template_kwargs`` become the server's default (``--default-chat-template-kwargs`` of
    both engines), so requests that send none are rendered as the drafter's training data was."""
    vllm_method, sglang_algorithm = METHODS[layout]
    cfg = drafter.config
    files = files or {}
    template = ["--default-chat-template-kwargs", describe(chat_template_kwargs)] if chat_template_kwargs else []
    if fmt == "vllm":
        spec = {"method": vllm_method, "model": model, "num_speculative_tokens": cfg.block_size}
        if layout in DSPARK_LAYOUTS and cfg.confidence_head:
            spec["enable_adaptive_verification"] = True
        command = " ".join(["vllm serve", shlex.quote(target), "--speculative-config", shlex.quote(json.dumps(spec)),
                            *map(shlex.quote, template)])
        return {"speculative_config": spec, "command": command}
    args = ["--model-path", target, "--speculative-algorithm", sglang_algorithm,
            "--speculative-draft-model-path", model]
    env = {}
    if layout in DSPARK_LAYOUTS:
        args += ["--speculative-dspark-block-size", str(cfg.block_size)]
        if "sps" in files:
            args += ["--speculative-dspark-sps-table-path", files["sps"]]
        if "sts" in files:
            args += ["--speculative-dspark-confidence-sts-path", files["sts"]]
        env = dict(SGLANG_ENV)
    elif layout == "DFlashDraftModel":
        args += ["--speculative-num-draft-tokens", str(cfg.block_size + 1)]  # the block, anchor included
    elif cfg.tree:
        args += ["--speculative-num-steps", str(cfg.tree_depth), "--speculative-eagle-topk", str(cfg.tree_top_k),
                 "--speculative-num-draft-tokens", str(cfg.tree_total_tokens)]
    else:
        args += ["--speculative-num-steps", str(cfg.block_size), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(cfg.block_size + 1)]
    args += template
    prefix = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    command = " ".join([*prefix, "python -m sglang.launch_server", *map(shlex.quote, args)])
    return {"args": args, "env": env, "command": command}


def export(drafter, target, fmt: str, output: Path, target_name: str, checkpoint: Path | None = None,
           cost_table: Path | None = None, chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> dict:
    """Write ``drafter`` into ``output`` in the layout the engine (or speculators) reads, SGLang
    DSpark's side files (from ``checkpoint``'s calibration and ``cost_table``) and SERVE.md; returns
    the report (format, drafter, layout, method, output, target, the chat-template kwargs served, the
    engine settings, files, notes and the command). A warning when the drafter was trained (or, for
    SGLang, whose STS file comes from its calibration, calibrated) under other chat-template kwargs
    than ``chat_template_kwargs``. Everything is checked before the first file is written."""
    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    warn_if_other_kwargs(drafter, chat_template_kwargs, target.tokenizer, calibration=fmt == "sglang")
    if fmt == SPECULATORS:
        if cost_table is not None:
            raise DspecError("--cost-table is used by SGLang's DSpark only, not by the speculators format")
        layout, config, tensors = to_foreign(drafter, target, SPECULATORS)
        sidecars = Sidecars(notes=[SPECULATORS_NOTE])
        kind = config["speculators_model_type"]
    else:
        layout, config, tensors = to_foreign(drafter, target)
        check_engine_support(layout, config, fmt)
        sidecars, kind = engine_sidecars(drafter, layout, fmt, checkpoint, cost_table), method(layout, fmt)
    final = output.resolve()
    report = {"format": fmt, "drafter": drafter.name, "layout": layout, "method": kind,
              "output": str(final), "target": target_name, "chat_template_kwargs": dict(chat_template_kwargs),
              "files": sidecars.paths(final), "notes": sidecars.notes}
    if fmt == SPECULATORS:
        template = ["--default-chat-template-kwargs", describe(chat_template_kwargs)] if chat_template_kwargs else []
        report.update(speculators_command(config, report["output"], target_name, template))
    else:
        report.update(serve_command(fmt, layout, drafter, report["output"], target_name, report["files"],
                                    chat_template_kwargs))

    def build(folder: Path) -> None:  # the whole export, built beside and swapped in: one format per folder
        save(folder, config, tensors)
        sidecars.write(folder)
        atomic_write_text(folder / SERVE_FILE, serve_markdown(report, sidecars.notes))

    replace_folder(output, build)
    return report


def engine_sidecars(drafter, layout: str, fmt: str, checkpoint: Path | None, cost_table: Path | None) -> Sidecars:
    """SGLang DSpark's STS / SPS files (checked, not yet written), or the notes of the other engines."""
    dspark = layout in DSPARK_LAYOUTS
    if cost_table is not None and not (dspark and fmt == "sglang"):
        raise DspecError(f"--cost-table is used by SGLang's DSpark only, not by {fmt} {method(layout, fmt)}"
                         + (" (vLLM's DSpark profiles its own cost curves)" if dspark else ""))
    if dspark and fmt == "sglang" and checkpoint is not None:
        return sglang_sidecars(drafter, checkpoint, cost_table)
    if dspark and fmt == "vllm":
        return Sidecars(notes=["vLLM's DSpark profiles its cost curves and calibrates at startup: no side files"])
    return Sidecars()
