"""File names and readers shared by every layer: a drafter checkpoint folder's files, the
embedded assets, ``config.json`` reading and the readers of input files that name the option
they came from (docs/checkpoints.md)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from dspec_cli.core.errors import DspecError
from dspec_cli.core.records import parse_json

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
# what loading a checkpoint folder reads in it (glob patterns): a report written beside them is fine
CHECKPOINT_READS = (CONFIG_FILE, "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                    CALIBRATION_FILE, COST_TABLE_FILE, "generation_config.json", "tokenizer*", "special_tokens_map.json",
                    "chat_template.*")


def expect_folder(path: str | Path, what: str, noun: str = "folder") -> Path:
    """``path`` when it is a folder; else a one-line error starting with ``what`` and the path that
    says what is there instead: nothing ("not found"), a file, or something else."""
    p = Path(path)
    if p.is_dir():
        return p
    if not os.path.lexists(p):
        raise DspecError(f"{what} {path}: not found")
    if not p.exists():
        raise DspecError(f"{what} {path}: a symbolic link to nothing")
    raise DspecError(f"{what} {path}: is a file, not a {noun}")


def read_bytes(path: str | Path, what: str, noun: str = "file") -> bytes:
    """The bytes of an input file (a regular file, or a FIFO such as a shell's ``<(...)``); a
    folder, a missing file, a link to nothing, a device or socket, or an unreadable file is a
    one-line error starting with ``what`` (the option or role naming the file) and the path."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        gone = os.path.lexists(p)
        raise DspecError(f"{what} {path}: " + ("a symbolic link to nothing" if gone else "file not found")) from None
    except OSError as exc:
        raise DspecError(f"{what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise DspecError(f"{what} {path}: is a folder, not a {noun}")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise DspecError(f"{what} {path}: is a device or socket, not a {noun}")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise DspecError(f"{what} {path}: cannot read ({exc.strerror or exc})") from None


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of an input file (:func:`read_bytes`); bytes that are not UTF-8 are a
    one-line error starting with ``what`` and the path."""
    raw = read_bytes(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DspecError(f"{what} {path}: not a text file (byte {raw[exc.start]:#04x} at offset {exc.start} is "
                         "not UTF-8)") from None


def read_json(path: str | Path, what: str) -> Any:
    """An input JSON file (:func:`read_text`) parsed by :func:`~dspec_cli.core.records.parse_json`;
    errors name ``what``, the path and the line or field."""
    return parse_json(read_text(path, what), f"{what} {path}")


def read_config(path: Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict; one-line errors when missing or malformed."""
    file = expect_folder(path, "checkpoint", "checkpoint folder") / CONFIG_FILE
    if not file.is_file():
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} is missing")
    raw = read_json(file, "checkpoint")  # errors start "checkpoint PATH/config.json:", as its record's do
    if not isinstance(raw, dict) or not isinstance(raw.get("drafter_config", {}), dict):
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} must be an object with a 'drafter_config' object")
    return raw


def config_target(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``target`` section of a config.json ({} in checkpoints written before it existed)."""
    return raw["target"] if isinstance(raw.get("target"), dict) else {}
