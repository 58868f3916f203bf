"""Loading a :class:`RunConfig`: finding the YAML file, merging it and ``key=value`` overrides onto the
dataclass defaults with OmegaConf, and turning every OmegaConf/YAML failure into a one-line
:class:`ConfigError` that names the key, the value and the fix.

Merge order: dataclass defaults < YAML file < overrides (left to right). Each layer is checked against
the schema first, so an unknown key fails with its full dotted path and the closest valid name. Then:

- ``ref.megatron`` / ``critic.megatron`` (per-role options) start from ``actor.megatron``'s options: keys given
  there override the actor's (after all layers, so ``actor.megatron.recompute_granularity=full`` on the command line
  reaches every role). The layout keys (tp/pp/dp/vpp/cp/ep sizes) are ``actor.megatron``'s alone; under a role
  they still load when they equal the actor's (ignored, with a one-line note: :func:`_moved_layout_keys`) and
  fail when they differ;
- :data:`ALIASES` map keys users know from elsewhere onto their one home (``actor_rollout.backend`` is
  ``rollout.backend``); :func:`to_yaml` writes only the home keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import re
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.checks import fill_derived, validate
from hybridrl.config.layout import LAYOUT_KEYS, derived_dp, moved_key_message, options_of, world_size_of
from hybridrl.config.schema import ConfigError, RunConfig

CONFIG_DIR_ENV = "HYBRIDRL_CONFIG_DIR"
PACKAGED_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The ``configs/`` folder next to the ``hybridrl`` package (the repo root in an editable install)."""

ALIASES = {
    "actor_rollout.backend": "rollout.backend",
    "max_colocate_count": "resources.max_colocate_count",
    "rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",  # verl's home for it
}
"""Accepted spellings (YAML and overrides) -> the key they set. Setting both to different values fails."""


# ---- finding config files ---------------------------------------------------------------------------
def _search_dirs() -> list[Path]:
    env = os.environ.get(CONFIG_DIR_ENV, "")
    return [*(Path(d).expanduser() for d in env.split(os.pathsep) if d), PACKAGED_CONFIG_DIR]


def available_configs() -> list[str]:
    """Names of the YAML configs in ``$HYBRIDRL_CONFIG_DIR`` and the packaged ``configs/`` folder."""
    names = {p.name for d in _search_dirs() if d.is_dir() for p in d.iterdir() if p.suffix in (".yaml", ".yml")}
    return sorted(names)


def find_config(name_or_path: str | os.PathLike[str]) -> Path:
    """Resolve a config: (1) the path itself, (2) ``$HYBRIDRL_CONFIG_DIR/<name>``, (3) the packaged
    ``configs/<name>``. ``.yaml`` may be left off the name."""
    name = str(name_or_path)
    given = Path(name).expanduser()
    if given.is_file():
        return given
    names = [name] if name.endswith((".yaml", ".yml")) else [name, f"{name}.yaml"]
    tried = [str(given)]
    for folder in _search_dirs():
        for candidate in (folder / n for n in names):
            if candidate.is_file():
                return candidate
        tried.append(str(folder / name))
    available = available_configs()
    close = difflib.get_close_matches(Path(name).name, available, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    env = "" if os.environ.get(CONFIG_DIR_ENV) else f" (${CONFIG_DIR_ENV} unset)"
    raise ConfigError(
        f"config {name!r} not found; searched {', '.join(tried)}{env}; "
        f"available: {', '.join(available) or 'none'}{hint}"
    )


# ---- schema introspection (for key errors) ---------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _section(hint: Any) -> type | None:
    """The dataclass a field holds, or None for a value field."""
    inner, _ = _unwrap_optional(hint)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def _type_name(hint: Any) -> str:
    inner, optional = _unwrap_optional(hint)
    names = {int: "an int", float: "a number", bool: "a bool (true/false)", str: "a string"}
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner)
        plurals = {int: "ints", float: "numbers", bool: "bools", str: "strings"}
        name = f"a list of {plurals.get(elem, elem.__name__)}"
    elif _section(inner) is not None:
        name = f"a section ({inner.__name__})"
    else:
        name = names.get(inner, getattr(inner, "__name__", str(inner)))
    return f"{name} or null" if optional else name


def _hint_at(path: str) -> Any:
    """Type hint of a dotted key such as ``actor.optim.betas[1]`` (list index -> element type)."""
    hint: Any = RunConfig
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            hint = typing.get_args(_unwrap_optional(hint)[0])[0]
        else:
            hint = _hints(_section(hint))[part]
    return hint


@functools.cache
def _all_keys() -> tuple[str, ...]:
    """Every valid dotted key (sections and values), then the alias keys."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, hint in _hints(cls).items():
            out.append(prefix + name)
            if (sub := _section(hint)) is not None:
                walk(sub, f"{prefix}{name}.")

    walk(RunConfig, "")
    return (*out, *ALIASES)


def _suggest(path: str) -> list[str]:
    """Closest valid keys for an unknown dotted key."""
    parts = path.split(".")
    cls: type | None = RunConfig
    i = 0
    while i < len(parts) - 1 and cls is not None and parts[i] in _hints(cls):
        cls = _section(_hints(cls)[parts[i]])
        i += 1
    keys = [k for k in _all_keys() if k not in ALIASES]
    prefix = ".".join(parts[:i]) + "." if i else ""
    tail = ".".join(parts[i:])
    rest = ".".join(parts[i + 1 :])
    siblings = list(_hints(cls)) if cls is not None else []
    # the same name one level deeper (actor.tp_size -> actor.megatron.tp_size)
    deeper = [k for k in keys if k.startswith(prefix) and k.endswith("." + tail)]
    if deeper:
        return sorted(deeper, key=len)[:3]
    # a typo of a sibling (actor.megatron.tp_szie -> actor.megatron.tp_size)
    for match in difflib.get_close_matches(parts[i], siblings, n=3):
        candidate = prefix + match + ("." + rest if rest else "")
        if candidate in keys:
            return [candidate]
    # the same name elsewhere (tp_size -> rollout.tp_size), or the right tail under a wrong section
    for suffix in (tail, rest):
        hits = [k for k in keys if suffix and (k == suffix or k.endswith("." + suffix))]
        if hits:
            return sorted(hits, key=len)[:3]
    return difflib.get_close_matches(path, _all_keys(), n=1, cutoff=0.5)


def _unknown_key(path: str, source: str) -> ConfigError:
    hits = _suggest(path)
    if len(hits) == 1:
        hint = f"; did you mean {hits[0]!r}?"
    elif hits:
        hint = "; did you mean one of " + ", ".join(repr(h) for h in hits) + "?"
    else:
        hint = ""
    return ConfigError(f"unknown config key {path!r}{hint}{source}", key=path)


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _check_keys(data: dict, cls: type, prefix: str, source: str) -> None:
    """Every key of ``data`` must be a field of ``cls``; sections must be mappings (recursively)."""
    hints = _hints(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            while isinstance(value, dict) and value:  # name the full path the user typed (its first leaf)
                key, value = next(iter(value.items()))
                path = f"{path}.{key}"
            raise _unknown_key(path, source)
        sub = _section(hints[key])
        if isinstance(value, str) and value.startswith("${"):
            continue  # interpolation, resolved (and type-checked) by OmegaConf
        if sub is not None and isinstance(value, dict):
            _check_keys(value, sub, path + ".", source)
        elif sub is not None and not (value is None and _unwrap_optional(hints[key])[1]):
            first = next(iter(_hints(sub)))
            raise ConfigError(
                f"{path} ({_show(value)}) must be {_type_name(hints[key])}; set its fields, e.g. "
                f"{path}.{first}=...{source}",
                key=path,
            )
        elif sub is None and isinstance(value, dict):
            raise ConfigError(f"{path} must be {_type_name(hints[key])}, not a mapping{source}", key=path)


# ---- layers -----------------------------------------------------------------------------------------
def _read_yaml(path: Path) -> dict:
    try:
        raw = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        where = str(exc).replace("\n", " ")
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {where}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections at top level, not a list")
    return OmegaConf.to_container(raw, resolve=False)


def _parse_override(override: str) -> dict:
    if not isinstance(override, str) or "=" not in override or not override.split("=", 1)[0].strip():
        raise ConfigError(f"override {override!r} must look like key=value, e.g. actor.megatron.tp_size=4")
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([override]), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        first = str(exc).splitlines()[0]
        key = override.split("=", 1)[0].strip()
        raise ConfigError(
            f"override {override!r}: cannot parse the value ({first}); quote it: {key}='...'", key=key
        ) from None
    return _keep_text(override, parsed)


def _keep_text(override: str, parsed: dict) -> dict:
    """A text field keeps the text as typed: YAML would read experiment_name=007 as 7 and =yes as True."""
    key, raw = (x.strip() for x in override.split("=", 1))
    parts = key.split(".")
    if "[" in key or raw in ("null", "~", "") or raw[:1] in ("'", '"', "[", "{") or "${" in raw:
        return parsed
    try:
        hint = _hint_at(key)
    except (KeyError, TypeError, IndexError):
        return parsed
    if _unwrap_optional(hint)[0] is not str:
        return parsed
    node = parsed
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = raw
    return parsed


def _pop_path(data: dict, parts: list[str]) -> tuple[bool, Any]:
    node = data
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    if parts[-1] not in node:
        return False, None
    value = node.pop(parts[-1])
    if len(parts) > 1 and not node:  # drop the emptied alias section
        _pop_path(data, parts[:-1])
    return True, value


def _apply_aliases(data: dict, source: str) -> dict:
    for alias, target in ALIASES.items():
        found, value = _pop_path(data, alias.split("."))
        if not found:
            continue
        node = data
        *parents, leaf = target.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if leaf in node and node[leaf] != value:
            raise ConfigError(
                f"{alias} ({_show(value)}) and {target} ({_show(node[leaf])}) are the same key with different "
                f"values{source}; set only {target}",
                key=target,
            )
        node[leaf] = value
    return data


def _deep_update(base: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _lookup(data: Any, path: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            data = data[int(part[1:-1])] if part.startswith("[") else data[part]
        except (KeyError, IndexError, TypeError):
            return "<unknown>"
    return data


def _translate(exc: OmegaConfBaseException, data: Any, source: str) -> ConfigError:
    """One-line ConfigError for an OmegaConf failure while merging/resolving ``data``."""
    key = getattr(exc, "full_key", None)
    first = str(exc).splitlines()[0]
    if not key:
        return ConfigError(f"invalid config{source}: {first}")
    if "nterpolation" in type(exc).__name__ or "nterpolation" in first:
        return ConfigError(f"{key}: {first}; fix the ${{...}} reference{source}", key=key)
    try:
        expected = _type_name(_hint_at(key))
    except (KeyError, TypeError, IndexError):
        return ConfigError(f"{key}: {first}{source}", key=key)
    value = _lookup(data, key)
    hint = f"; write it as a list: {key}=[{value}]" if expected.startswith("a list") and isinstance(value, str) else ""
    return ConfigError(f"{key} ({_show(value)}) must be {expected}{hint}{source}", key=key)


# ---- layout keys under a role -------------------------------------------------------------------------
MOVED_ROLES = ("ref", "critic")


def _pop_role_layout_keys(data: dict, source: str, moved: dict) -> None:
    """Take the layout keys out of ``ref.megatron`` / ``critic.megatron`` (their schema holds options only) into
    ``moved``: ``(role, key) -> (value, source)``, a later layer replacing an earlier one."""
    for role in MOVED_ROLES:
        section = data.get(role)
        megatron = section.get("megatron") if isinstance(section, dict) else None
        if not isinstance(megatron, dict):
            continue
        for key in LAYOUT_KEYS:
            if key in megatron:
                moved[(role, key)] = (megatron.pop(key), source)


def _moved_layout_keys(cfg: RunConfig, moved: dict, world_size: int | None) -> None:
    """Each layout key given under a role: a one-line note when it equals the actor's (it is ignored), a
    :class:`ConfigError` naming both values when it differs."""
    m = cfg.actor.megatron
    for (role, key), (value, source) in moved.items():
        actors = getattr(m, key)
        if key == "dp_size" and actors is None:  # derived later; compare with what it will be
            actors = derived_dp(m, world_size_of(cfg, world_size))
        if isinstance(value, str) and value.startswith("${"):
            value = actors  # an interpolation (of the actor's key, as users write it): nothing to compare
        failed, line = moved_key_message(role, key, value, actors, source)
        if failed:
            raise ConfigError(line, key=f"{role}.megatron.{key}")
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # once per job
            print(f"[hybridrl] {line}", file=sys.stderr, flush=True)


# ---- public API -------------------------------------------------------------------------------------
def compose_config(
    name_or_path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), world_size: int | None = None
) -> RunConfig:
    """Dataclass defaults < YAML < overrides, typed and key-checked, with nothing derived or validated but the
    layout keys written under ``ref.megatron`` / ``critic.megatron`` (compared with the actor's; a ``dp_size`` there
    with the actor's derived, over ``world_size``, default the config's nodes x processes).

    Use :func:`load_config` to run; this is for tools that want the config exactly as written.
    """
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, not the string {overrides!r}")
    layers: list[tuple[str, dict]] = []
    if name_or_path is not None:
        path = find_config(name_or_path)
        layers.append((f" (in {path})", _read_yaml(path)))
    layers += [(f" (from override {ov!r})", _parse_override(ov)) for ov in overrides]

    merged = OmegaConf.structured(RunConfig)
    given: dict = {}
    moved: dict = {}
    for source, data in layers:
        data = _apply_aliases(data, source)
        _pop_role_layout_keys(data, source, moved)
        _check_keys(data, RunConfig, "", source)
        try:
            merged = OmegaConf.merge(merged, data)
        except OmegaConfBaseException as exc:
            raise _translate(exc, data, source) from None
        _deep_update(given, data)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _translate(exc, given, "") from None
    for role in MOVED_ROLES:  # a role's options start from the actor's; the keys it gives override them
        written = given.get(role, {}).get("megatron") if isinstance(given.get(role), dict) else None
        section = getattr(cfg, role)
        if isinstance(written, dict) and section.megatron is not None:
            ours = {k: getattr(section.megatron, k) for k in written}
            section.megatron = dataclasses.replace(options_of(cfg.actor.megatron), **ours)
    _moved_layout_keys(cfg, moved, world_size)
    return cfg


def load_config(
    name_or_path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
) -> RunConfig:
    """Load, complete and validate a run config.

    Args:
        name_or_path: a YAML path, or a config name found in ``$HYBRIDRL_CONFIG_DIR`` or the packaged
            ``configs/`` folder (``"ppo_llama2_7b.yaml"``). None = dataclass defaults only.
        overrides: ``key=value`` strings in OmegaConf dotlist syntax (``trainer.loggers=[console,jsonl]``).
        world_size: ranks of the launch; None = ``trainer.nnodes * trainer.n_gpus_per_node``. A given
            value must equal that product.

    Returns:
        A :class:`RunConfig` with derived fields filled in (``actor.megatron.dp_size``, ...).

    Raises:
        ConfigError: one line naming the key, the value and the fix.
    """
    cfg = compose_config(name_or_path, overrides, world_size)
    fill_derived(cfg, world_size)
    validate(cfg, world_size)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML (home keys only); :func:`load_config` of it gives an equal config."""
    try:
        return OmegaConf.to_yaml(OmegaConf.structured(cfg), sort_keys=False)
    except OmegaConfBaseException as exc:
        raise _translate(exc, dataclasses.asdict(cfg), "") from None
