"""Loading a configuration: YAML in (a file, or the defaults), dotted ``section.field=value`` overrides as NeMo
takes them, each value checked against its field's type, then the rules (``rules.validate``); and the YAML that
reads back to the same configuration."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from moe_overlap.config.rules import validate
from moe_overlap.config.schema import Config, ConfigError

# The dispatch fields of the three paths that the MoE pipeline replaced: (their default, what to write instead).
_REPLACED = {
    "overlap.moe_overlap_dispatch": (False, "use overlap.moe_pipeline=true overlap.moe_planning=host"),
    "overlap.moe_sync_free_dispatch": (False, "use overlap.moe_pipeline=true overlap.moe_planning=device"),
    "overlap.moe_a2a_chunks": (1, "use overlap.moe_pipeline_chunks"),
    "train.expert_wgrad_pairs": (False, "use train.expert_wgrad_micro_batches=2"),
    "overlap.moe_a2a_backend": ("auto", "use overlap.moe_transport (symm: copy_engine with overlap.moe_planning=host, "
                                        "sm_push with overlap.moe_planning=device; auto, nccl, gloo as before)"),
}


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` and ``1.0e5`` as floats (YAML 1.2); PyYAML's YAML 1.1 rules
    need a dot and a signed exponent, and would hand ``lr: 1e-4`` over as the string '1e-4'."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or the defaults) plus ``section.field=value`` overrides, typed and checked field by field.

    World-size rules are checked separately by :func:`validate_for_world`, once the world size is known.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml_file(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def config_yaml(cfg: Config) -> str:
    """The whole config as YAML that :func:`load_config` reads back to the same config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _read_yaml_file(path: Path) -> dict:
    """The file's mapping of sections; malformed YAML is named by file, line and column."""
    if not path.is_file():
        raise ConfigError("config", str(path), "no such file")
    sections = f"the YAML must be a mapping of sections ({', '.join(f.name for f in dataclasses.fields(Config))})"
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_YamlLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)  # 1-based, as editors
        raise ConfigError("config", where, f"not valid YAML: {_yaml_problem(err)}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("config", str(path), f"cannot be read as a text file ({err})") from err
    if raw is None:
        raise ConfigError("config", str(path), f"is empty; {sections}")
    if not isinstance(raw, dict):
        what = "a list" if isinstance(raw, list) else f"the single value {raw!r}"
        raise ConfigError("config", str(path), f"holds {what}; {sections}")
    return raw


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's problem and its context, on one line."""
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context = getattr(err, "context", None)
    return f"{problem} ({' '.join(str(context).split())})" if context else problem


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        why = "has no '='" if not sep else "names no section.field"
        raise ConfigError("override", item, f"{why}: expected section.field=value, e.g. "
                          "parallel.expert_model_parallel_size=2")
    section, name = parts
    if raw.get(section) is None:  # absent, or an empty section in the file (`parallel:` with no fields)
        raw[section] = {}
    if not isinstance(raw[section], dict):
        raise ConfigError(section, raw[section], "a section must be a mapping")
    # YAML parses the value, so `true`, `3`, `1e-3`, `null` and `[0,1,1]` mean what they do in the file.
    try:
        raw[section][name] = yaml.load(text, Loader=_YamlLoader) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError("override", item, f"the value is not valid YAML: {_yaml_problem(err)}") from err


def _suggest(name: str, choices: list[str], kind: str = "field") -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"unknown {kind}; did you mean {close[0]!r}?" if close else f"unknown {kind}; known: {', '.join(choices)}"


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "expected a mapping")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if f"{prefix}{key}" in _REPLACED:
            default, replacement = _REPLACED[f"{prefix}{key}"]
            if raw[key] != default:  # at its default (as every saved config.yaml holds it) it means the new default
                raise ConfigError(f"{prefix}{key}", raw[key], f"was replaced: {replacement}")
        elif key not in names:
            raise ConfigError(f"{prefix}{key}", raw[key], _suggest(str(key), names, "field" if prefix else "section"))
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, raw[f.name], f"{prefix}{f.name}.")
        else:
            values[f.name] = _coerce(raw[f.name], tp, f"{prefix}{f.name}")
    return cls(**values)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, typing.get_args(tp)[0], name) for v in value]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(name, value, f"expected {_describe(tp)}")
