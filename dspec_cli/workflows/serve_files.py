"""What ``dspec export`` writes beside the draft weights: SGLang's STS / SPS side files and SERVE.md.

For SGLang's DSpark the export folder gets ``sglang/dspark_sts.json`` (the checkpoint's STS
temperatures fitted under the token rule, from ``calibration.json``) and ``sglang/dspark_sps.json`` (from ``--cost-table``,
else the checkpoint's ``cost_table.json``): a dspec table becomes SGLang's diagonal table, an
SGLang table is copied field by field. Each is left out, with a note, when there is nothing to
write it from. vLLM's DSpark profiles its cost curves and calibrates at startup, so it gets no
side files. ``SERVE.md`` records the serve command and every note.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dspec_cli.core import sglang_sps
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.chat_template import describe
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CALIBRATION_FILE, COST_TABLE_FILE, read_json
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.outputs import write_json
from dspec_cli.workflows import sglang_sts

SIDECAR_DIR = "sglang"
SERVE_FILE = "SERVE.md"
FORWARD_NOTE = ("the cost table times target forwards only, while SGLang's planner prices whole DSpark steps "
                "(drafting, verification, host work), so it overstates what trimming saves: profile with "
                "`dspec profile-hardware --drafter NAME`")


@dataclass
class Sidecars:
    """The side files of one export, built (and checked) before anything is written."""

    sts: dict | None = None
    sps: dict | None = None
    notes: list[str] = field(default_factory=list)

    def paths(self, output: Path) -> dict[str, str]:
        """{"sts" / "sps": absolute path} of the files :meth:`write` writes."""
        names = {"sts": sglang_sts.STS_FILE, "sps": sglang_sps.SPS_FILE}
        return {k: str((output / SIDECAR_DIR / names[k]).resolve()) for k in names if getattr(self, k) is not None}

    def write(self, output: Path) -> dict[str, str]:
        paths = self.paths(output)
        for key, path in paths.items():
            write_json(Path(path), getattr(self, key))
        return paths


def sglang_sidecars(drafter, checkpoint: Path, cost_table: Path | None) -> Sidecars:
    """STS from ``checkpoint/calibration.json`` (its token-rule temperatures: SGLang's DSpark
    verifies token by token), SPS from ``cost_table`` (default: the checkpoint's
    ``cost_table.json``); DspecError if either file does not fit the drafter, or the calibration
    has no token-rule fit."""

    gamma = drafter.config.block_size
    out = Sidecars()
    if (checkpoint / CALIBRATION_FILE).is_file():
        cal = Calibration.load(checkpoint / CALIBRATION_FILE, drafter=drafter.name, block_size=gamma)
        before = cal.fit(sglang_sts.SGLANG_RULE).metrics.get("before")  # a file's metrics: any JSON
        counts = before.get("count") if isinstance(before, dict) else None
        rounds = counts[0] if isinstance(counts, list) and counts and isinstance(counts[0], int) else 0
        out.sts = sglang_sts.sts_dict(cal, dataset=str(checkpoint / CALIBRATION_FILE), num_samples=rounds)
        if not cal.recorded_rule:
            out.notes.append(f"{CALIBRATION_FILE} records no verification rule: its temperatures are taken as the "
                             f"{sglang_sts.SGLANG_RULE} rule's, which SGLang verifies by")
    else:
        out.notes.append(f"no {CALIBRATION_FILE} in the checkpoint: SGLang uses the raw confidences "
                         "(fit one with `dspec calibrate`)")
    what = "--cost-table"
    if cost_table is None and (checkpoint / COST_TABLE_FILE).is_file():
        cost_table, what = checkpoint / COST_TABLE_FILE, "checkpoint cost table"
    if cost_table is None:
        out.notes.append("no cost table: SGLang's planner falls back to verifying every draft "
                         "(give --cost-table from `dspec profile-hardware --drafter NAME`)")
        return out
    table = CostTable.load(cost_table, block_size=gamma, what=what)
    raw = read_json(cost_table, what)
    schema = sglang_sps.sps_schema(raw)
    if schema is not None:  # already SGLang's: copy its fields
        fields = sglang_sps.ADDITIVE_FIELDS if schema == "additive" else sglang_sps.DIAGONAL_FIELDS
        out.sps = {k: raw[k] for k in fields}
    else:
        out.sps = sglang_sps.to_sglang_diagonal(table)
        if table.measures == "forward":
            out.notes.append(FORWARD_NOTE)
        elif table.block_size and table.block_size != gamma:
            raise DspecError(f"cost table {cost_table} was profiled at block size {table.block_size}, "
                             f"this drafter's is {gamma}")
    return out


def serve_markdown(report: dict, notes: list[str]) -> str:
    """SERVE.md: the command, the settings and files it uses, and the notes."""
    engine = "vLLM (speculators format)" if report["format"] == "speculators" else report["format"]
    lines = [f"# Serving this drafter with {engine}", "",
             f"Drafter `{report['drafter']}` in the `{report['layout']}` layout (method `{report['method']}`), "
             f"for the target `{report['target']}`.", "", "```", report["command"], "```", ""]
    if report.get("chat_template_kwargs"):
        served = describe(report["chat_template_kwargs"])
        lines += [(f"Requests without their own `chat_template_kwargs` are rendered with `{served}` "
                   "(`--default-chat-template-kwargs`); the drafter accepts most in the mode its training data "
                   "was rendered in."), ""]
    if report["format"] in ("vllm", "speculators"):
        lines += ["`speculative_config`:", "", "```json", json.dumps(report["speculative_config"], indent=2), "```", ""]
    else:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in report.get("env", {}).items())
        if env:
            lines += [f"Environment: `{env}`.", ""]
        for key, label in (("sts", "STS temperatures"), ("sps", "SPS cost table")):
            if key in report.get("files", {}):
                lines.append(f"- {label}: `{report['files'][key]}`")
        lines.append("")
    if notes:
        lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
