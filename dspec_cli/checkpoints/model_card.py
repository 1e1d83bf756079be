"""README.md model cards of drafter checkpoints: Hub metadata, description, measured results.

The YAML front matter always carries ``library_name: dspec``, ``tags: [speculative-decoding,
<drafter>]`` and, for a target on the Hub, ``base_model: <target>``. The "Measured" section sits
between two HTML comments and is rebuilt from the folder's ``bench.json`` and ``calibration.json``
by :func:`refresh_model_card` (``dspec push``), so the published card shows the latest numbers
while the rest of a hand-edited card is kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspec_cli.checkpoints.hub import is_repo_id
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.chat_template import DEFAULT_KWARGS, describe, mode
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import BENCH_FILE, CALIBRATION_FILE, CARD_FILE, config_target
from dspec_cli.core.version import __version__

MEASURED_BEGIN = "<!-- dspec:measured -->"
MEASURED_END = "<!-- /dspec:measured -->"


def card_metadata(drafter: str, target: str) -> dict[str, Any]:
    """The front-matter keys dspec owns."""

    meta: dict[str, Any] = {"library_name": "dspec", "tags": ["speculative-decoding", drafter]}
    if is_repo_id(target) and not Path(target).exists():
        meta["base_model"] = target
    return meta


def render_card(meta: dict[str, Any], body: str) -> str:
    from huggingface_hub import ModelCardData

    return f"---\n{ModelCardData(**meta).to_yaml()}\n---\n{body}"


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def measured_section(folder: Path) -> str:
    """τ and speedup from bench.json; per verification rule, ECE before/after and temperatures from calibration.json."""
    lines: list[str] = []
    bench = folder / BENCH_FILE
    if bench.is_file():
        try:
            report = json.loads(bench.read_text())
            runs = report["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DspecError(f"{bench}: not a `dspec bench --json` report ({exc})") from None
        env = report.get("env", {})
        device = env.get("device_name") or env.get("device", "?")
        lines += [
            f"`dspec bench` (dspec {env.get('dspec', '?')}) on {device}, target `{report.get('target', '?')}`:",
            "",
            "| dataset | drafter | scheduler | concurrency | T | τ | speedup |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in runs:
            cells = [r.get("dataset"), r.get("drafter"), r.get("scheduler"), r.get("concurrency"),
                     _fmt(r.get("temperature"), "g"), _fmt(r.get("tau"), ".2f"), "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    if (folder / CALIBRATION_FILE).is_file():
        cal = Calibration.load(folder / CALIBRATION_FILE)
        lines += ["Confidence calibration (`dspec calibrate`), per verification rule:", ""]
        for rule in cal.rules:
            fit = cal.fits[rule]
            before, after = fit.metrics.get("before", {}), fit.metrics.get("after", {})
            held = fit.metrics.get("heldout", {}).get("after", {}).get("ece_mean")
            temps = ", ".join(f"{t:.3g}" for t in fit.temperatures)
            form = "survival map" if fit.slope is not None else "STS"
            ece = (f"mean ECE {_fmt(before.get('ece_mean'), '.3f')} before, {_fmt(after.get('ece_mean'), '.3f')} after"
                   + (f" ({held:.3f} held-out)" if held is not None else ""))
            name = rule if cal.recorded_rule else f"{rule} (taken as: the file records no rule)"
            lines.append(f"- {name}: {form}, {ece}; STS temperatures per position [{temps}]")
        lines.append("")
    if not lines:
        lines = [
            ("No measurements yet: put a `dspec bench --json bench.json` report and `dspec calibrate`'s "
             "calibration.json in the checkpoint folder."),
            "",
        ]
    return "\n".join([MEASURED_BEGIN, "## Measured", "", *lines, MEASURED_END])


def _default_body(drafter: str, target: str, repo_id: str | None) -> str:

    name = Path(target).name
    if Path(target).is_absolute():  # a path on the machine that saved it: show only its name
        shown, flag = f"{name} (a local model)", f" --target <path of {name}>"
    elif target in ("", "embedded"):
        shown, flag = "dspec's embedded tiny target" if target else "its target", ""
    else:
        shown, flag = target, f" --target {target}"
    lines = [
        "", f"# {drafter} drafter for {shown}", "",
        (f"A `{drafter}` speculative-decoding drafter published with dspec {__version__}. "
         "Output is lossless: the target verifies every drafted token."),
        "", "## Use", "", "```", f"dspec bench --drafter {drafter} --checkpoint {repo_id or '<this folder>'}{flag}",
        "```", "",
    ]
    return "\n".join(lines)


def refresh_model_card(folder: Path, config: dict[str, Any], repo_id: str | None = None) -> str:
    """The folder's README.md (or a new card) with dspec's metadata and a rebuilt "Measured" section."""
    from huggingface_hub import ModelCard, ModelCardData

    drafter = config["drafter"]
    target = config_target(config).get("name_or_path", "")
    file = folder / CARD_FILE
    meta = card_metadata(drafter, target)
    text = file.read_text() if file.is_file() else _default_body(drafter, target, repo_id)
    card = ModelCard(text if text.startswith("---") else render_card(meta, text), ignore_metadata_errors=True)
    data = card.data
    assert isinstance(data, ModelCardData)  # a ModelCard's data (huggingface_hub types it as CardData)
    for key, value in meta.items():
        if key == "tags":
            data.tags = [str(t) for t in dict.fromkeys([*(data.tags or []), *value])]
        elif getattr(data, key, None) is None:  # ModelCardData keeps unknown metadata keys as attributes
            setattr(data, key, value)
    body, section = card.text, measured_section(folder)
    if MEASURED_BEGIN in body and MEASURED_END in body:
        head, rest = body.split(MEASURED_BEGIN, 1)
        body = head + section + rest.split(MEASURED_END, 1)[1]
    else:
        body = body.rstrip("\n") + "\n\n" + section + "\n"
    card.text = body
    return str(card)


def write_model_card(out: Path, info: dict[str, Any]) -> None:
    """README.md for a trained drafter: what it is, what it was trained on (with which chat-template
    kwargs), final metrics."""

    target, drafter = info["target"], info["drafter"]
    kwargs = info.get("chat_template_kwargs", DEFAULT_KWARGS)
    label = mode(kwargs)
    flag = "" if dict(kwargs) == dict(DEFAULT_KWARGS) else f" --chat-template-kwargs '{describe(kwargs)}'"
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in info["metrics"].items() if isinstance(v, int | float))
    data = info["data"]  # its chat_template_kwargs: what the data's lines record -> how many
    regenerated = ", ".join(f"`{k}` ({n} conversations)" for k, n in data.get("chat_template_kwargs", {}).items())
    lines = [
        "",
        f"# {drafter} drafter for {target}",
        "",
        (f"A `{drafter}` speculative-decoding drafter trained with `dspec train` (dspec {__version__}). "
         "Output is lossless: the target verifies every drafted token."),
        "",
        "| | |",
        "|---|---|",
        f"| drafter | `{drafter}` |",
        f"| target | `{target}` |",
        f"| chat template kwargs | `{describe(kwargs)}`" + (f" ({label} mode)" if label else "") + " |",
        (f"| training data | `{', '.join(data['path']) if isinstance(data['path'], list) else data['path']}`: {data['samples']} samples ({data['skipped']} skipped, {data.get('truncated', 0)} truncated), "
         f"{data['tokens']} tokens, {data['loss_tokens']} assistant tokens |"),
        *([f"| data regenerated with | {regenerated} |"] if regenerated else []),
        (f"| steps | {info['step']} of {info['total_steps']} ({info['epochs']:.2f} epochs), "
         f"global batch {info['global_batch']} |"),
        f"| optimizer | AdamW, lr {info['lr']:g}, {info['schedule']} schedule, warmup {info['warmup_ratio']:g} |",
        f"| world size | {info['world_size']} |",
        *([f"| initialised from | `{info['init_from']}` (fine-tuned) |"] if info.get("init_from") else []),
        f"| final metrics | {metrics or '-'} |",
        "",
        "## Use",
        "",
        "```",
        f"dspec bench --drafter {drafter} --checkpoint <this folder>"
        + ("" if info.get("target_is_embedded") else f" --target {target}") + flag,
        "```",
        "",
        "## Recipe",
        "",
        "The training recipe with command-line overrides applied (TOML structure as JSON):",
        "",
        "```json",
        json.dumps(info["recipe"], indent=2),
        "```",
        "",
        measured_section(out),
        "",
    ]
    (out / CARD_FILE).write_text(render_card(card_metadata(drafter, target), "\n".join(lines)))
