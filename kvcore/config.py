"""Typed configuration built from a YAML file, environment variables and command-line flags.

Precedence: flags override the environment, the environment overrides the file, the file overrides defaults.
A configuration is a frozen dataclass whose fields are declared with `option()`: the metadata carries the help
text, so `--help`, the environment names (`PREFIX` + the field name in capitals) and the YAML keys are all derived
from one declaration. One command may read several such classes from the same file, environment and flags (the
gateway's own settings and each strategy's): `also` names the others, whose keys are then not unknown.

A field's value is converted by its type (str, int, float, bool, a list of those, `T | None`), by the option's
`parse` for strings, or, for a YAML value that is not a string, by the type's `from_yaml(value)` if it has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is missing, malformed or of the wrong type."""


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
           aliases: Sequence[str] = ()) -> Any:
    """A config field with its help text; `parse` turns one string (flag, env, YAML scalar) into a value;
    `aliases` are other YAML keys accepted for it."""
    meta = {"help": help, "parse": parse, "aliases": tuple(aliases)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _field_type(cls: type, f: dataclasses.Field[Any]) -> Any:
    return typing.get_type_hints(cls)[f.name]


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _scalar(tp: Any) -> Any:
    """The element type of list[T], or T of `T | None`."""
    if _is_list(tp):
        return typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _convert(cls: type, f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    """Turn a raw value (string from a flag or env, or a YAML value) into the field's type."""
    tp = _field_type(cls, f)
    parse = f.metadata.get("parse")
    elem = _scalar(tp)
    from_yaml = getattr(elem, "from_yaml", None)

    def one(value: Any) -> Any:
        try:
            if isinstance(value, str) and parse is not None:
                return parse(value)
            if from_yaml is not None:
                return from_yaml(value)
            if elem is bool:
                if isinstance(value, bool):
                    return value
                lowered = str(value).strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if elem in (int, float) and isinstance(value, bool):
                raise ValueError(value)
            return elem(value)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {f.name} = {value!r} is not a valid {elem.__name__}") from exc

    if raw is None:
        return None
    if _is_list(tp):
        if isinstance(raw, str):
            raw = [part for part in raw.replace(",", " ").split() if part]
        if not isinstance(raw, list):
            raise ConfigError(f"{source}: {f.name} must be a list")
        return [one(v) for v in raw]
    return one(raw)


def _fields(classes: Sequence[type]) -> dict[str, tuple[type, dataclasses.Field[Any]]]:
    """Every field of the classes by name, each name once (the first class declaring it owns it)."""
    out: dict[str, tuple[type, dataclasses.Field[Any]]] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, (cls, f))
    return out


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str, *,
                         also: Sequence[type] = ()) -> None:
    """Add one flag per config field (of `cls` and of the classes in `also`), with its help, default and
    environment variable name."""
    parser.add_argument("--config", metavar="FILE", help=f"YAML file with any of the options below "
                        f"(env {env_prefix}CONFIG)")
    for owner, f in _fields([cls, *also]).values():
        flag = "--" + f.name.replace("_", "-")
        env = env_prefix + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        shown = default if default not in ("", []) else "none"
        help_text = f"{f.metadata['help']} (default: {shown}; env {env})"
        if _is_list(_field_type(owner, f)):
            parser.add_argument(flag, action="append", default=None, help=help_text)
        elif _scalar(_field_type(owner, f)) is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, default=None, help=help_text)


def load_config(
    cls: type[C],
    env_prefix: str,
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    also: Sequence[type] = (),
) -> C:
    """Build the config: defaults < YAML file < environment < flags. Keys of the classes in `also` may stand in
    the file too (they are read by their own `load_config`); any other key is an error."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    known = _fields([cls, *also])
    aliases = {alias: name for name, (_, f) in known.items() for alias in f.metadata.get("aliases", ())}
    path = (getattr(args, "config", None) if args else None) or environ.get(env_prefix + "CONFIG")
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping")
        for key, raw in loaded.items():
            name = str(key).replace("-", "_")
            name = aliases.get(name, name)
            if name not in known:
                raise ConfigError(f"{path}: unknown option {key!r}")
            if name in fields:
                values[name] = _convert(cls, fields[name], raw, path)
    for name, f in fields.items():
        env = env_prefix + name.upper()
        if env in environ:
            values[name] = _convert(cls, f, environ[env], env)
    if args is not None:
        for name, f in fields.items():
            raw = getattr(args, name, None)
            if raw is not None:
                if isinstance(raw, list):
                    raw = [item for chunk in raw for item in chunk.split(",") if item]
                values[name] = _convert(cls, f, raw, "--" + name.replace("_", "-"))
    return cls(**values)


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@\s]*?:)[^/@\s]+(?=@)", re.I)


def redact_url(text: str) -> str:
    """`redis://user:secret@host` -> `redis://user:***@host` (also inside longer text)."""
    return _URL_PASSWORD.sub(lambda m: m.group("head") + "***", text)


def describe(config: Any, hide: Sequence[str] = ("api_key", "admin_key", "upstream_api_key")) -> dict[str, Any]:
    """The config as plain data for logs, with secrets masked: the `hide` fields, and the password of every URL."""
    out = dataclasses.asdict(config)
    for key, value in out.items():
        if key in hide and value:
            out[key] = "***"
        elif isinstance(value, str):
            out[key] = redact_url(value)
        elif isinstance(value, list):
            out[key] = [redact_url(v) if isinstance(v, str) else v for v in value]
    return out
