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

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspec_cli.core.chat_template import check_kwargs, default_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import EMBEDDED, read_text
from dspec_cli.core.sampling import SamplingConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]



@dataclass
class TargetSpec:
    name: str = EMBEDDED  # Hub id or local path; "embedded" = the embedded tiny target
    dtype: str = "auto"  # weights of the frozen target: auto (CUDA bfloat16, CPU float32) | bfloat16 | float16 | float32
    vocab_size: int = 0  # expected sizes, checked after loading (0 = not checked)
    hidden_size: int = 0
    num_layers: int = 0


@dataclass
class DataSpec:
    path: str | list[str] = ""  # target-regenerated conversations: one jsonl or several, concatenated in order
    # (`dspec data regenerate --recipe` writes the first; see its --output for the others)
    max_length: int = 4096  # tokens per sample after the chat template (longer ones are truncated)
    min_loss_tokens: int = 14  # samples with fewer assistant tokens are skipped
    limit: int = 0  # use the first N conversations (0 = all)

    @property
    def paths(self) -> list[str]:
        """data.path as a list (empty when unset)."""
        return [self.path] if isinstance(self.path, str) and self.path else list(self.path or [])


@dataclass(frozen=True)
class ChatSampling(SamplingConfig):
    """Sampling for regenerated chat answers: Qwen3's non-thinking recommendations."""

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8


@dataclass(frozen=True)
class RegenerateSpec(ChatSampling):
    prompts: str = ""  # prompt file that `dspec data regenerate --recipe` turns into data.path (its first file)
    max_new_tokens: int = 4096
    concurrency: int = 32
    limit: int = 0


@dataclass
class TrainSpec:
    epochs: float = 10.0
    max_steps: int = 0  # optimizer steps; 0 = ceil(epochs * samples / global_batch)
    global_batch: int = 512  # samples per optimizer step, all ranks together
    micro_batch: int = 1  # samples per forward; accumulation = global / (micro * world)
    lr: float = 6e-4
    warmup_ratio: float = 0.04  # linear warmup over this share of the steps
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    seed: int = 42
    dtype: str = "bfloat16"  # autocast dtype on CUDA (float32 = off); CPU runs float32
    device: str = "auto"  # auto = cuda:LOCAL_RANK when available, else cpu
    save_every: int = 3000  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 0  # keep the newest N step_* checkpoints (0 = all)
    log_every: int = 1  # metrics-log row every N steps
    shard: str = "none"  # none: every rank holds the drafter (DDP) | fsdp: FSDP2 fully_shard across ranks

    def __post_init__(self) -> None:
        positive = {"global_batch": self.global_batch, "micro_batch": self.micro_batch, "log_every": self.log_every}
        for key, value in positive.items():
            if value < 1:
                raise DspecError(f"recipe: train.{key} must be >= 1, got {value}")
        for key in ("max_steps", "save_every", "keep_checkpoints", "weight_decay", "grad_clip", "lr", "epochs"):
            if getattr(self, key) < 0:
                raise DspecError(f"recipe: train.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.warmup_ratio < 1:
            raise DspecError(f"recipe: train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.shard not in ("none", "fsdp"):
            raise DspecError(f"recipe: train.shard must be none or fsdp, got {self.shard!r}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise DspecError(f"recipe: train.schedule must be cosine, linear or constant, got {self.schedule!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise DspecError(f"recipe: train.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


SECTIONS: dict[str, type] = {"target": TargetSpec, "data": DataSpec, "regenerate": RegenerateSpec, "train": TrainSpec}
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
    def from_dict(cls, raw: dict[str, Any], source: str = "recipe") -> Recipe:
        valid = [*TOP_LEVEL, *SECTIONS, CHAT_TEMPLATE, "drafter"]
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise DspecError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
        out: dict[str, Any] = {"source": source}
        for key, value in raw.items():
            if key in SECTIONS:
                out[key] = _section(SECTIONS[key], value, source, key)
            elif key == CHAT_TEMPLATE:
                out[key] = check_kwargs(value, f"{source}: [{CHAT_TEMPLATE}]")
            elif key == "drafter":
                if not isinstance(value, dict):
                    raise DspecError(f"{source}: [drafter] must be a table, got {type(value).__name__}")
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
            out[name] = {k: _plain(v) for k, v in dataclasses.asdict(getattr(self, name)).items()}
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


def _section(spec: type, value: Any, source: str, name: str) -> Any:
    if not isinstance(value, dict):
        raise DspecError(f"{source}: [{name}] must be a table, got {type(value).__name__}")
    hints = typing.get_type_hints(spec)
    unknown = sorted(set(value) - set(hints))
    if unknown:
        raise DspecError(
            f"{source}: unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}; "
            f"valid keys in [{name}]: {', '.join(hints)}"
        )
    return spec(**{k: check_type(v, hints[k], f"{source}: {name}.{k}") for k, v in value.items()})


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
        if isinstance(value, int | float) and not isinstance(value, bool):
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


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file and apply ``section.key=value`` overrides."""
    return Recipe.from_dict(apply_overrides(read_toml(path), overrides), source=str(path))


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
