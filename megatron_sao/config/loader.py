"""YAML recipes + dotted overrides -> a typed, validated `SaoConfig`.

Strict by design: an unknown key, a value of the wrong type or an impossible combination is an
error before anything starts, naming the key, where it came from (file or command line) and, for
typos, the closest valid key. A recipe may name a `base:` recipe (path relative to itself) whose
values it overrides, so one YAML per model x task x cluster stays short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from megatron_sao.config.errors import ConfigError
from megatron_sao.config.placement import check_engine_layout
from megatron_sao.config.ranges import validate_names, validate_numbers
from megatron_sao.config.schema import SaoConfig
from megatron_sao.config.validate import validate_config

COMMAND_LINE = "command line"
# Input paths written in a recipe are relative to that recipe file (so recipes work from any
# working directory); on the command line they are relative to the working directory.
RECIPE_RELATIVE_PATHS = ("model.hf_path", "data.train_path", "data.trajectories_path", "actor.load", "critic.load",
                         "value_pretrain.corpus_dir", "eval.prompts_path")


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in get_type_hints(cls).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        if dataclasses.is_dataclass(hint):
            keys.extend(_all_keys(hint, dotted + "."))
    return keys


def _suggest(key: str, root: type) -> str:
    close = difflib.get_close_matches(key, _all_keys(root), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    plain = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    if hint in plain:
        return plain[hint]
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _coerce(value: Any, hint: Any, key: str, source: str, raw_text: str | None, yaml_error: str = "") -> Any:
    """Return `value` as type `hint`, or raise ConfigError naming `key` and `source`."""

    def fail(expected: str) -> ConfigError:
        shown = raw_text if raw_text is not None else repr(value)
        why = f"; the value is not valid YAML ({yaml_error}), so it was read as a plain string" if yaml_error else ""
        return ConfigError(f"{key}: expected {expected}, got {shown} (from {source}){why}")

    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key, source, raw_text, yaml_error)
            except ConfigError as e:
                errors.append(e)
        raise fail(" or ".join(_type_name(o) for o in options)) from errors[-1]
    if origin is Literal:
        if value not in get_args(hint):
            raise fail(_type_name(hint))
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise fail("a boolean (true/false)")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail("an integer")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads `1e-6` (no dot) as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise fail("a number")
        if not math.isfinite(number):  # NaN / inf pass every `<` check downstream: refuse them here
            raise fail("a finite number")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        if raw_text is not None:  # a command-line value for a string field is taken verbatim
            return raw_text
        raise fail("a string")
    if origin is list:
        (item_hint,) = get_args(hint)
        if not isinstance(value, list):
            raise fail(f"a list of {_type_name(item_hint)}")
        return [_coerce(v, item_hint, f"{key}[{i}]", source, None, yaml_error) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise fail("a mapping")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        raise fail(f"a mapping of {hint.__name__} fields")
    raise AssertionError(f"unsupported config type {hint!r} for {key}")


def _build(cls: type, data: dict[str, Any], sources: dict[str, str], raw: dict[str, str], prefix: str,
           yaml_errors: dict[str, str]):
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise ConfigError(
                f"unknown key '{key}' (from {sources.get(key, COMMAND_LINE)})" + _suggest(key, SaoConfig)
            )
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of {hint.__name__} fields "
                                  f"(from {sources.get(key, COMMAND_LINE)})")
            kwargs[name] = _build(hint, value, sources, raw, key + ".", yaml_errors)
        else:
            kwargs[name] = _coerce(value, hint, key, sources.get(key, COMMAND_LINE), raw.get(key),
                                   yaml_errors.get(key, ""))
    return cls(**kwargs)


def _record_sources(data: dict[str, Any], source: str, sources: dict[str, str], prefix: str = "") -> None:
    for name, value in data.items():
        key = f"{prefix}{name}"
        sources[key] = source
        if isinstance(value, dict):
            _record_sources(value, source, sources, key + ".")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping: PyYAML keeps the last silently,
    so a second `actor:` section would drop the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in first:
                raise ConfigError(f"line {line}: duplicate key {key!r} (first at line {first[key]}): merge the two "
                                  "into one")
            if isinstance(key, str | int | float | bool):
                first[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_recipe(path: Path, sources: dict[str, str], seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: recipe `base:` chain loops back to itself")
    if not path.is_file():
        referrer = f" (the `base:` of {seen[-1]})" if seen else ""
        raise ConfigError(f"recipe file not found: {path}{referrer}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the recipe as UTF-8") from e
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    except ConfigError as e:
        raise ConfigError(f"{path} {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    merged: dict[str, Any] = {}
    if base is not None:
        merged = _read_recipe(path.parent / str(base), sources, (*seen, path))
    _record_sources(data, str(path), sources)
    return _merge(merged, data)


def parse_override(text: str) -> tuple[str, Any, str]:
    """`a.b=value` -> (`a.b`, YAML-parsed value, raw value text). A value that is not valid YAML
    is kept as its raw text (a string field takes it verbatim); see `_parse_override`."""
    key, value, raw_value, _ = _parse_override(text)
    return key, value, raw_value


def _parse_override(text: str) -> tuple[str, Any, str, str]:
    """`parse_override` plus the YAML error of the value ('' when it parsed)."""
    key, sep, raw_value = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return key, raw_value, raw_value, str(problem)
    return key, value, raw_value, ""


def load_config(recipe: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SaoConfig:
    """Load `recipe` (YAML), apply `overrides` (`section.key=value`), type-check and validate."""
    sources: dict[str, str] = {}
    data = _read_recipe(Path(recipe), sources) if recipe is not None else {}
    raw: dict[str, str] = {}
    yaml_errors: dict[str, str] = {}
    for text in overrides:
        key, value, raw_value, yaml_error = _parse_override(text)
        if yaml_error:
            yaml_errors[key] = yaml_error
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = child
        node[parts[-1]] = value
        sources[key] = COMMAND_LINE
        raw[key] = raw_value
    for key in RECIPE_RELATIVE_PATHS:
        section, name = key.split(".")
        value = data.get(section, {}).get(name) if isinstance(data.get(section), dict) else None
        source = sources.get(key, COMMAND_LINE)
        if isinstance(value, str) and value and source != COMMAND_LINE and not Path(value).is_absolute():
            data[section][name] = str((Path(source).parent / value).resolve())
    config = _build(SaoConfig, data, sources, raw, "", yaml_errors)
    validate_names(config, sources)
    validate_numbers(config, sources)
    where = str(recipe) if recipe is not None else COMMAND_LINE
    if raw and recipe is not None:  # cross-field checks cannot tell which side a value came from: say both
        where += f" with command-line overrides of {', '.join(sorted(raw))}"
    validate_config(config, source=where)
    try:  # SGLang engine layouts that cannot work (weight-sync mode x placement, engines across nodes)
        check_engine_layout(config)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {where})") from None
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_config(config: SaoConfig, path: str | Path) -> Path:
    """Write the fully resolved config as YAML (loadable again with `load_config`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    return path
