"""Training recipes: TOML files with ``[target]``, ``[chat_template]``, ``[data]``, ``[regenerate]``,
``[drafter]`` and ``[train]`` sections (docs/training.md lists every key).

``[chat_template]`` holds the keyword arguments of the target's chat template (e.g.
``enable_thinking = true``) that regeneration and training render conversations with; a recipe
without it gets :data:`~dspec_cli.core.chat_template.DEFAULT_KWARGS`, and a table present is the
whole set (an empty table passes none).

``[drafter]`` holds the fields of the drafter's ``config_class``; it is checked once the drafter
class is known (:meth:`Recipe.drafter_config`). Every other key is fixed here: an unknown key at
any level is an error that lists the valid ones, and values are type-checked. Command-line
overrides look like ``train.lr=3e-4`` or ``drafter.target_layer_ids=[1,2]``; the value is read as
TOML, falling back to a plain string (``target.name=Qwen/Qwen3-8B``).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator

from dspec_cli.core.chat_template import check_kwargs, default_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import EMBEDDED, read_text
from dspec_cli.core.records import (
    MAX_CONCURRENCY,
    MAX_DEPTH,
    Count,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Record,
    check_tree,
    first_error,
)
from dspec_cli.core.sampling import SamplingConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]



Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]
Ratio = Annotated[float, Field(ge=0, lt=1)]


class TargetSpec(Record):
    name: str = EMBEDDED  # Hub id or local path; "embedded" = the embedded tiny target
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # weights of the frozen target
    vocab_size: Count = 0  # expected sizes, checked after loading (0 = not checked)
    hidden_size: Count = 0
    num_layers: Count = 0


class DataSpec(Record):
    path: str | list[str] = ""  # target-regenerated conversations: one jsonl or several, concatenated in order
    # (`dspec data regenerate --recipe` writes the first; see its --output for the others)
    max_length: PositiveInt = 4096  # tokens per sample after the chat template (longer ones are truncated)
    min_loss_tokens: Count = 14  # samples with fewer assistant tokens are skipped
    limit: Count = 0  # use the first N conversations (0 = all)

    @property
    def paths(self) -> list[str]:
        """data.path as a list (empty when unset)."""
        return [self.path] if isinstance(self.path, str) and self.path else list(self.path or [])


@dataclass(frozen=True)
class ChatSampling(SamplingConfig):
    """Sampling for regenerated chat answers: Qwen3's non-thinking recommendations (the defaults
    of ``dspec data regenerate`` and of a recipe's ``[regenerate]``)."""

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8


class RegenerateSpec(Record):
    """A recipe's ``[regenerate]`` table, a typed record; its sampling defaults are :class:`ChatSampling`'s."""

    prompts: str = ""  # prompt file that `dspec data regenerate --recipe` turns into data.path (its first file)
    max_new_tokens: PositiveInt = 4096
    temperature: NonNegativeFloat = ChatSampling.temperature
    top_p: Annotated[float, Field(gt=0, le=1)] = ChatSampling.top_p
    top_k: Count = ChatSampling.top_k
    concurrency: Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)] = 32
    limit: Count = 0
    seed: Seed = ChatSampling.seed


class TrainSpec(Record):
    epochs: NonNegativeFloat = 10.0
    max_steps: Count = 0  # optimizer steps; 0 = ceil(epochs * samples / global_batch)
    global_batch: PositiveInt = 512  # samples per optimizer step, all ranks together
    micro_batch: PositiveInt = 1  # samples per forward; accumulation = global / (micro * world)
    lr: NonNegativeFloat = 6e-4
    warmup_ratio: Ratio = 0.04  # linear warmup over this share of the steps
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # after warmup
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0  # final lr = lr * min_lr_ratio
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Ratio, Ratio] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0  # max global grad norm (0 = off)
    seed: Seed = 42
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # autocast dtype on CUDA (float32 = off); CPU runs float32
    device: str = "auto"  # auto = cuda:LOCAL_RANK when available, else cpu
    save_every: Count = 3000  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: Count = 0  # keep the newest N step_* checkpoints (0 = all)
    log_every: PositiveInt = 1  # metrics-log row every N steps
    shard: Literal["none", "fsdp"] = "none"  # none: every rank holds the drafter (DDP) | fsdp: FSDP2 fully_shard across ranks

    @field_validator("betas", mode="before")
    @classmethod
    def _list_as_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value


SECTIONS: dict[str, type[Record]] = {"target": TargetSpec, "data": DataSpec, "regenerate": RegenerateSpec, "train": TrainSpec}
TOP_LEVEL = {"description": str}
CHAT_TEMPLATE = "chat_template"  # the free-form [chat_template] table
# keys a resumed run may change without breaking exact continuation
RESUME_SAFE = {
    "train.save_every", "train.keep_checkpoints", "train.log_every", "train.device", "description", "regenerate",
}


@dataclass
class Recipe:
    drafter: str = ""  # [drafter] name: the drafter this recipe is written for ("" = any)
    description: str = ""
    target: TargetSpec = field(default_factory=TargetSpec)
    data: DataSpec = field(default_factory=DataSpec)
    regenerate: RegenerateSpec = field(default_factory=RegenerateSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    chat_template: dict[str, Any] = field(default_factory=default_kwargs)  # the [chat_template] table
    drafter_section: dict[str, Any] = field(default_factory=dict)  # the raw [drafter] table
    source: str = ""  # file it came from

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "recipe", labels: Mapping[str, str] | None = None) -> Recipe:
        """A recipe from its TOML structure; ``labels``: dotted key -> what the user typed to set it
        (an override, an option), named by errors instead of the file."""
        labels = labels or {}
        valid = [*TOP_LEVEL, *SECTIONS, CHAT_TEMPLATE, "drafter"]
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise DspecError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
        out: dict[str, Any] = {"source": source}
        for key, value in raw.items():
            if key in SECTIONS:
                out[key] = _section(SECTIONS[key], value, source, key, labels)
            elif key == CHAT_TEMPLATE:
                out[key] = check_kwargs(value, f"{source}: [{CHAT_TEMPLATE}]")
            elif key == "drafter":
                if not isinstance(value, dict):
                    raise DspecError(f"{source}: [drafter] must be a table, got {type(value).__name__}")
                for k, v in value.items():  # plain values: no NaN, no dates, bounded depth
                    check_tree(v, labels.get(f"drafter.{k}") or f"{source}: drafter.{k}")
                table = dict(value)
                out["drafter"] = check_type(table.pop("name", ""), str, f"{source}: drafter.name")
                out["drafter_section"] = table
            else:
                out[key] = check_type(value, TOP_LEVEL[key], f"{source}: {key}")
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        """The TOML structure (tuples as lists); ``from_dict(to_dict())`` round-trips."""
        out: dict[str, Any] = {"description": self.description}
        for name in SECTIONS:
            out[name] = {k: _plain(v) for k, v in getattr(self, name).model_dump().items()}
        out[CHAT_TEMPLATE] = dict(self.chat_template)
        out["drafter"] = {"name": self.drafter, **{k: _plain(v) for k, v in self.drafter_section.items()}}
        return out

    def drafter_config(self, drafter_cls: type) -> Any:
        """The drafter's config object from ``[drafter]`` (type-checked against its fields)."""
        config_cls = drafter_cls.config_class
        hints = typing.get_type_hints(config_cls)
        values = {}
        for key, value in self.drafter_section.items():
            values[key] = check_type(value, hints[key], f"{self.source}: drafter.{key}") if key in hints else value
        return config_cls.from_dict(values, where=f"{self.source} [drafter]")


def _section(spec: type[Record], value: Any, source: str, name: str, labels: Mapping[str, str]) -> Any:
    """Section ``[name]`` of a recipe as its record; errors name the key, and what the user typed
    for it (``labels``: dotted key -> an override or option) where it did not come from the file."""
    if not isinstance(value, dict):
        raise DspecError(f"{source}: [{name}] must be a table, got {type(value).__name__}")
    fields = list(spec.model_fields)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise DspecError(
            f"{source}: unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}; "
            f"valid keys in [{name}]: {', '.join(fields)}"
        )
    try:
        return spec.model_validate(value)
    except ValidationError as exc:
        path, problem = first_error(exc)
        key = f"{name}.{path}"
        label = labels.get(f"{name}.{path.split('.')[0].split('[')[0]}")
        raise DspecError(f"{label}: {problem}" if label else f"{source}: {key}: {problem}") from None


def check_type(value: Any, hint: Any, where: str) -> Any:
    """``value`` converted to ``hint`` (int -> float, list -> tuple); DspecError when it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None) and value is None:
                return None
            try:
                return check_type(value, arg, where)
            except DspecError:
                continue
        raise DspecError(f"{where}: expected {_name(hint)}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise DspecError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise DspecError(f"{where}: expected a list of {len(args)} values, got {value!r}")
            item_hints = list(args)
        else:
            item_hints = [args[0] if args else Any] * len(value)
        items = [check_type(v, h, where) for v, h in zip(value, item_hints, strict=True)]
        return tuple(items) if origin is tuple else items
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(origin or hint, type):  # str, bool, dict, dict[str, ...], ...
        if isinstance(value, origin or hint):
            return value
    else:  # Any and other annotations: not checked here
        return value
    raise DspecError(f"{where}: expected {_name(hint)}, got {value!r}")


def _name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}
    return names.get(hint, str(hint).replace("typing.", ""))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value); the value is TOML or a plain string."""
    key, sep, raw = text.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(parts):
        raise DspecError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except RecursionError:
        raise DspecError(f"override {text!r}: nested deeper than {MAX_DEPTH} levels") from None
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the TOML structure ``raw`` with the overrides set (checked later by from_dict)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        parts, value = parse_override(text)
        if len(parts) > 2:
            raise DspecError(f"override {text!r}: keys have at most two levels (section.key)")
        if len(parts) == 1:
            out[parts[0]] = value
            continue
        section = out.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise DspecError(f"override {text!r}: {parts[0]!r} is not a section")
        section[parts[1]] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path, "--recipe"))
    except tomllib.TOMLDecodeError as exc:
        raise DspecError(f"--recipe {path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise DspecError(f"--recipe {path}: nested deeper than {MAX_DEPTH} levels") from None


def load_recipe(path: str | Path, overrides: Sequence[str] = (), labels: Mapping[str, str] | None = None) -> Recipe:
    """Read a recipe file and apply ``section.key=value`` overrides; errors in an overridden value
    name the override (``labels``: dotted key -> what else the user typed for it, e.g. an option)."""
    return Recipe.from_dict(apply_overrides(read_toml(path), overrides), source=str(path),
                            labels={**override_labels(overrides), **(labels or {})})


def override_labels(overrides: Sequence[str]) -> dict[str, str]:
    """Dotted key -> ``override 'KEY=VALUE'`` for each override (what errors name)."""
    return {".".join(parse_override(text)[0]): f"override {text!r}" for text in overrides}


def recipe_diff(a: Recipe, b: Recipe) -> list[str]:
    """Dotted keys whose values differ between two recipes."""
    da, db = _flat(a.to_dict()), _flat(b.to_dict())
    return sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))


def resume_conflicts(saved: Recipe, current: Recipe) -> list[str]:
    """Changed keys that would make a resumed run differ from an uninterrupted one."""
    return [k for k in recipe_diff(saved, current) if k not in RESUME_SAFE and k.split(".")[0] not in RESUME_SAFE]


def describe_changes(a: Recipe, b: Recipe, keys: Sequence[str]) -> str:
    """"train.lr 0.0006 -> 0.0003, ..." for the dotted ``keys`` (from :func:`recipe_diff`)."""
    da, db = _flat(a.to_dict()), _flat(b.to_dict())
    return ", ".join(f"{k} {da.get(k)!r} -> {db.get(k)!r}" for k in keys)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
