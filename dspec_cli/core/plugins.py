"""Plugin manager: loads entry points of group ``dspec`` and collects registrations.

Built-in drafters are registered through the same entry-point group (see pyproject.toml)
as third-party packages. ``DSPEC_LOAD_PLUGINS`` (comma-separated entry-point or
distribution names; empty = none) restricts which entry points load; the package's own core
entry points (the built-in schedulers, in ``dspec_cli``) load regardless.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from dspec_cli.core import hookspecs
from dspec_cli.core.errors import DspecError

GROUP = "dspec"


@dataclass
class Registered:
    """One registered class (drafter or scheduler) and where it came from."""

    name: str
    cls: type
    plugin: str
    package: str
    version: str
    aliases: tuple[str, ...] = ()


@dataclass
class Registry:
    drafters: dict[str, Registered] = field(default_factory=dict)
    schedulers: dict[str, Registered] = field(default_factory=dict)
    aliases: dict[str, dict[str, str]] = field(default_factory=lambda: {"drafters": {}, "schedulers": {}})
    layouts: list = field(default_factory=list)  # foreign checkpoint layouts (checkpoints.layouts.Layout)
    problems: list[str] = field(default_factory=list)


pm = pluggy.PluginManager(GROUP)
pm.add_hookspecs(hookspecs)
_dist: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
_load_problems: list[str] = []
_loaded = False


def _allowed() -> set[str] | None:
    raw = os.environ.get("DSPEC_LOAD_PLUGINS")
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def load_plugins() -> None:
    """Import every ``dspec`` entry point once; a plugin that fails is reported, not fatal."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    allowed = _allowed()
    for ep in entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist else "?"
        core = ep.value.split(":")[0].startswith("dspec_cli.")
        if allowed is not None and not core and ep.name not in allowed and dist not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            _load_problems.append(f"plugin {ep.name!r} ({dist}) failed to import: {type(exc).__name__}: {exc}")
            continue
        pm.register(module, name=ep.name)
        _dist[ep.name] = (dist, ep.dist.version if ep.dist else "?")


def _collect(hook_name: str, kind: str, registry: Registry) -> None:
    table: dict[str, Registered] = getattr(registry, kind)
    aliases = registry.aliases[kind]
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        plugin = impl.plugin_name
        package, version = _dist.get(plugin, (plugin, "-"))

        def register(cls, aliases_: tuple[str, ...] | list[str] = (), *, _plugin=plugin, _pkg=package, _ver=version, **kw):
            alias_list = tuple(kw.pop("aliases", aliases_))
            name = getattr(cls, "name", None)
            if not name:
                registry.problems.append(f"plugin {_plugin!r} registered {cls!r} without a name")
                return
            if name in table or name in aliases:
                owner = table[name].plugin if name in table else table[aliases[name]].plugin
                registry.problems.append(
                    f"plugin {_plugin!r}: {kind[:-1]} name {name!r} is already registered by plugin {owner!r}; ignored"
                )
                return
            table[name] = Registered(name, cls, _plugin, _pkg, _ver, alias_list)
            for alias in alias_list:
                if alias in table or alias in aliases:
                    registry.problems.append(f"plugin {_plugin!r}: alias {alias!r} is already taken; ignored")
                else:
                    aliases[alias] = name

        try:
            impl.function(register=register)
        except Exception as exc:
            registry.problems.append(f"plugin {plugin!r} failed in {hook_name}: {type(exc).__name__}: {exc}")


def _collect_layouts(registry: Registry) -> None:
    seen: dict[str, str] = {}
    for impl in pm.hook.dspec_register_layouts.get_hookimpls():
        plugin = impl.plugin_name

        def register(layout, *, _plugin=plugin):
            arch = getattr(layout, "architecture", None)
            if not arch:
                registry.problems.append(f"plugin {_plugin!r} registered a layout without an architecture")
            elif arch in seen:
                registry.problems.append(f"plugin {_plugin!r}: layout {arch!r} is already registered by plugin "
                                         f"{seen[arch]!r}; ignored")
            else:
                seen[arch] = _plugin
                registry.layouts.append(layout)

        try:
            impl.function(register=register)
        except Exception as exc:
            registry.problems.append(f"plugin {plugin!r} failed in dspec_register_layouts: {type(exc).__name__}: {exc}")


def registry() -> Registry:
    """Collect every registration from the loaded plugins (cheap; recomputed per call)."""
    load_plugins()
    reg = Registry(problems=list(_load_problems))
    _collect("dspec_register_drafters", "drafters", reg)
    _collect("dspec_register_schedulers", "schedulers", reg)
    _collect_layouts(reg)
    return reg


def _resolve(kind: str, name: str) -> Registered:
    reg = registry()
    table: dict[str, Registered] = getattr(reg, kind)
    name = reg.aliases[kind].get(name, name)
    if name not in table:
        names = sorted(list(table) + list(reg.aliases[kind]))
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise DspecError(f"unknown {kind[:-1]} {name!r}; {guess}known {kind}: {', '.join(names) or 'none'}")
    return table[name]


def get_drafter_class(name: str) -> type:
    """The drafter class registered under ``name`` (or an alias); DspecError lists the known ones."""
    return _resolve("drafters", name).cls


def get_scheduler_class(name: str) -> type:
    return _resolve("schedulers", name).cls
