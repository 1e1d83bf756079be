"""File names and readers shared by every layer: a drafter checkpoint folder's files, the
embedded assets, ``config.json`` reading and atomic text writes (docs/checkpoints.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspec_cli.core.errors import DspecError

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED = "embedded"  # target name of the embedded tiny default


def embedded_path(name: str) -> Path:
    """Path of an embedded asset (``tiny-target``, ``tiny-draft-model``, ...); may not exist."""
    return ASSETS_DIR / name


DEFAULT_TARGET_PATH = embedded_path("tiny-target")
CALIBRATION_FILE = "calibration.json"  # a dspec_cli.core.calibration.Calibration
CONFIG_FILE = "config.json"


WEIGHTS_FILE = "model.safetensors"


COST_TABLE_FILE = "cost_table.json"  # a dspec_cli.core.hardware.CostTable


BENCH_FILE = "bench.json"  # a `dspec bench --json` report


CARD_FILE = "README.md"


PUBLISHED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE, COST_TABLE_FILE, BENCH_FILE, CARD_FILE)


def read_config(path: Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict; one-line errors when missing or malformed."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} is missing")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("drafter_config", {}), dict):
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} must be an object with a 'drafter_config' object")
    return raw


def config_target(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``target`` section of a config.json ({} in checkpoints written before it existed)."""
    return raw["target"] if isinstance(raw.get("target"), dict) else {}
