"""Plugin discovery through entry points, one group per kind: request stages (`tokenflow.stages`, your
middleware), schedulers (`tokenflow.schedulers`), KV pools (`tokenflow.kv_pools`), KV tiers
(`tokenflow.kv_tiers`), backends (`tokenflow.backends`) and eviction policies.

Built-ins are registered in tokenflow's own pyproject.toml exactly as a third party registers theirs, and
load through this one path. A scheduler or pool a plugin still registers in `tokenflow.stages` (where they
all lived before) is found there too, with a deprecation warning.
`TOKENFLOW_PLUGINS` is an allow-list of third-party entry-point names
(comma-separated; empty or unset allows all, `none` allows none); built-ins
always load.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from tokenflow.errors import PluginError
from tokenflow.extras import PLUGIN_DISTRIBUTIONS, install_hint
from tokenflow.kv.eviction import EvictionPolicy
from tokenflow.protocols import (
    OPTIONAL_HOOKS,
    KVPool,
    KVTier,
    ModelBackend,
    RequestStage,
    Scheduler,
    StaticScheduler,
    hooks_missing,
)

__all__ = (
    "BACKENDS", "KV_POOLS", "POLICIES", "SCHEDULERS", "STAGES", "TIERS", "PluginInfo", "find", "list_plugins",
    "load_backend", "load_policy", "load_pool", "load_scheduler", "load_stage", "load_tier",
)

STAGES = "tokenflow.stages"
SCHEDULERS = "tokenflow.schedulers"
KV_POOLS = "tokenflow.kv_pools"
BACKENDS = "tokenflow.backends"
POLICIES = "tokenflow.eviction_policies"
TIERS = "tokenflow.kv_tiers"
_BUILTIN_DIST = "tokenflow-engine"  # the distribution name of this package (the import name is tokenflow)

# Which protocol makes which kind, checked in order.
_KINDS: tuple[tuple[str, type], ...] = (
    ("request", RequestStage),
    ("loop", Scheduler),
    ("loop", StaticScheduler),
    ("backend", ModelBackend),
    ("memory", KVPool),
    ("policy", EvictionPolicy),
    ("tier", KVTier),
)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    group: str
    value: str
    origin: str  # distribution name and version
    builtin: bool
    allowed: bool


def _origin(ep: EntryPoint) -> tuple[str, bool]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", False
    name = dist.metadata["Name"] or "unknown"
    return f"{name} {dist.version}", name.lower() == _BUILTIN_DIST


def _allow_list() -> set[str] | None:
    raw = os.environ.get("TOKENFLOW_PLUGINS", "").strip()
    if not raw:
        return None
    if raw.lower() == "none":
        return set()
    return {item.strip() for item in raw.split(",") if item.strip()}


def list_plugins(group: str | None = None) -> list[PluginInfo]:
    allowed = _allow_list()
    found: list[PluginInfo] = []
    for grp in (group,) if group else (STAGES, SCHEDULERS, KV_POOLS, TIERS, BACKENDS, POLICIES):
        for ep in sorted(entry_points(group=grp), key=lambda e: e.name):
            origin, builtin = _origin(ep)
            ok = builtin or allowed is None or ep.name in allowed
            found.append(PluginInfo(ep.name, grp, ep.value, origin, builtin, ok))
    return found


def find(group: str, name: str) -> EntryPoint:
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        known = ", ".join(sorted(ep.name for ep in entry_points(group=group))) or "none"
        extra = PLUGIN_DISTRIBUTIONS.get((group, name))
        hint = f"; it comes with the `{extra}` extra: {install_hint(extra)}" if extra else ""
        raise PluginError(f"no plugin named {name!r} in entry-point group {group!r} (found: {known}){hint}")
    # A third-party plugin may not shadow a built-in silently: prefer the built-in.
    matches.sort(key=lambda ep: not _origin(ep)[1])
    ep = matches[0]
    origin, builtin = _origin(ep)
    allowed = _allow_list()
    if not builtin and allowed is not None and name not in allowed:
        raise PluginError(
            f"plugin {name!r} ({ep.value}, from {origin}) is not in TOKENFLOW_PLUGINS; add it to load it"
        )
    return ep


def _load_factory(ep: EntryPoint) -> Callable[..., Any]:
    try:
        factory = ep.load()
    except Exception as exc:
        raise PluginError(f"entry point {ep.group}:{ep.name} = {ep.value!r} failed to import: {exc!r}") from exc
    if not callable(factory):
        raise PluginError(f"entry point {ep.group}:{ep.name} = {ep.value!r} is not callable")
    return factory


def kind_of(obj: Any) -> str | None:
    for kind, proto in _KINDS:
        if isinstance(obj, proto):
            return kind
    return None


def _missing(obj: Any, proto: type) -> list[str]:
    methods = [n for n in dir(proto) if not n.startswith("_")]
    attributes = list(getattr(proto, "__annotations__", {}))
    return [n for n in methods if not callable(getattr(obj, n, None))] + [n for n in attributes if not hasattr(obj, n)]


def _build(group: str, name: str, config: Any, expected: tuple[str, ...], **sizes: Any) -> Any:
    ep = find(group, name)
    factory = _load_factory(ep)
    try:
        obj = factory(config, **sizes)
    except Exception as exc:
        raise PluginError(f"entry point {group}:{name} = {ep.value!r}: factory failed: {exc!r}") from exc
    kind = kind_of(obj)
    if kind not in expected:
        proto = next(p for k, p in _KINDS if k == expected[0])
        missing = ", ".join(_missing(obj, proto)) or "(unknown)"
        raise PluginError(
            f"entry point {group}:{name} = {ep.value!r} returned {type(obj).__name__}, which does not "
            f"implement the {expected[0]} protocol {proto.__name__}: missing {missing}"
        )
    if kind == "request" and not inspect.iscoroutinefunction(obj.handle):
        raise PluginError(f"entry point {group}:{name}: `handle` must be an async method")
    for hooks in OPTIONAL_HOOKS.get(kind or "", ()):  # all or none of each set: a misspelled hook is never called
        missing = hooks_missing(obj, hooks)
        if missing:
            raise PluginError(f"entry point {group}:{name} = {ep.value!r} implements part of the optional "
                              f"{hooks.__name__} hooks but not {', '.join(missing)} (misspelled?)")
    return obj


def load_stage(name: str, config: Any, *, kinds: tuple[str, ...] = ("request",)) -> Any:
    """A request stage (your middleware) from `tokenflow.stages`."""
    return _build(STAGES, name, config, kinds)


def load_scheduler(name: str, config: Any) -> Any:
    """The step loop's scheduler, from `tokenflow.schedulers` (the `scheduler` setting)."""
    return _build(_group_of(SCHEDULERS, name), name, config, ("loop",))


def load_backend(name: str, config: Any) -> Any:
    return _build(BACKENDS, name, config, ("backend",))


def load_pool(name: str, config: Any, **sizes: Any) -> Any:
    """The KV block pool, from `tokenflow.kv_pools`: its factory also gets the pool's sizes as keywords."""
    return _build(_group_of(KV_POOLS, name), name, config, ("memory",), **sizes)


def _group_of(group: str, name: str) -> str:
    """`group`, or `tokenflow.stages` for a plugin registered there the old way (with a warning)."""
    if any(ep.name == name for ep in entry_points(group=group)):
        return group
    if any(ep.name == name for ep in entry_points(group=STAGES)):
        warnings.warn(f"plugin {name!r} is registered in {STAGES!r}; register it in {group!r} (the old group is "
                      "read for now)", DeprecationWarning, stacklevel=3)
        return STAGES
    return group


def load_policy(name: str, config: Any) -> Any:
    """An eviction policy for the token pool, from the `tokenflow.eviction_policies` group."""
    return _build(POLICIES, name, config, ("policy",))


def load_tier(name: str, config: Any) -> Any:
    """A KV tier below the pool, from the `tokenflow.kv_tiers` group (the `kv_tiers` setting)."""
    return _build(TIERS, name, config, ("tier",))
