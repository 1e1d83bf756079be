"""Drafter and scheduler specs as the CLI takes them: ``NAME[:BASE][,KEY=VALUE...]``, resolved
through the plugin registry, option values typed by the class's own defaults; and the rule for
the block size every drafter shares (:func:`check_block_size`)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any

from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.records import parse_json

MAX_INT = 2**31 - 1  # integer spec options (sizes, counts, delays): beyond it a value is a typo


def _split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``HEAD[,KEY=VALUE...]`` -> (HEAD, raw options); commas inside values (JSON lists) stay."""
    head, *pairs = re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", spec)
    raw = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        raw[key.strip()] = value.strip()
    return head, raw


def _typed_options(flag: str, spec: str, raw: dict[str, str], defaults: dict[str, Any], hint: str = "") -> dict[str, Any]:
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise DspecError(f"{flag} {spec!r}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(defaults) or 'none'}{hint}")
    return {key: _option_value(flag, spec, key, value, defaults[key]) for key, value in raw.items()}


def parse_drafter_spec(spec: str) -> tuple[type, dict[str, Any]]:
    """``NAME[:BASE][,KEY=VALUE...]`` -> (drafter class, config overrides); ``:BASE`` means
    ``base=BASE`` (``ddtree:dspark``). Values take the type of the config field's default."""
    head, raw = _split_spec(spec)
    name, colon, base = head.partition(":")
    cls = plugins.get_drafter_class(name.strip())
    if colon:
        raw = {"base": base.strip(), **raw}
    defaults = {f.name: f.default for f in dataclasses.fields(cls.config_class) if f.name != "block_size"}
    options = _typed_options("--drafter", spec, raw, defaults, " (the block size is --block-size)")
    try:  # the config's own checks (ranges) before any model loads
        cls.config_class(**options)
    except DspecError as exc:
        raise DspecError(f"--drafter {spec!r}: {exc}") from None
    except TypeError:
        pass  # a config with required fields: checked when the drafter is built
    return cls, options


def parse_scheduler_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME[,KEY=VALUE...]`` -> (scheduler name, constructor options), e.g. ``hardware,gate=false``.
    Valid keys are the keyword parameters of the scheduler's constructors (calibration aside)."""
    head, raw = _split_spec(spec)
    name = head.strip()
    cls = plugins.get_scheduler_class(name)
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name != "context" and p.name not in defaults:
                defaults[p.name] = p.default
    options = _typed_options("--scheduler", spec, raw, defaults)
    if options:  # the scheduler's own checks (ranges, types) before any model loads, on a one-point table
        try:
            cls(_probe_table(), **options)
        except (DspecError, TypeError, ValueError) as exc:
            raise DspecError(f"--scheduler {spec!r}: {str(exc).strip().splitlines()[0]}") from None
    return name, options


def _probe_table() -> CostTable:
    """A one-point cost table: what a scheduler needs to be built for its options to be checked."""
    return CostTable("", "", "", "", "", [1], [0], {"0": [1.0]})


def _option_value(flag: str, spec: str, key: str, value: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()]
        if isinstance(default, float) and not math.isfinite(float(value)):
            raise DspecError(f"{flag} {spec!r}: {key} must be a finite number, got {value!r}")
        if isinstance(default, int) and not -MAX_INT <= int(value) <= MAX_INT:
            raise DspecError(f"{flag} {spec!r}: {key} is out of range (|{key}| < 2^31), got {value}")
        if isinstance(default, (int, float, str)):
            return type(default)(value)
        return parse_json(value, f"{flag} {spec!r}: {key}")
    except (KeyError, ValueError):
        kind = type(default).__name__ if default not in (dataclasses.MISSING, None) else "JSON"
        raise DspecError(f"{flag} {spec!r}: {key} expects {kind}, got {value!r}") from None


def check_block_size(value: Any, what: str = "--block-size") -> int:
    """The one rule for a block size γ (draft tokens per round), wherever one is given: an integer
    >= 1 (and, for a checkpoint, at most the γ it was trained with:
    ``CheckpointConfig.check_trained_block_size``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DspecError(f"{what} must be >= 1 (an integer), got {value!r}")
    return value
