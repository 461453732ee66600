"""Field documentation of the config tree, read from the docstrings under each field."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
from functools import cache
from typing import Any, get_type_hints

from megatron_sao.config import schema
from megatron_sao.config.schema import SaoConfig


@cache
def _field_docs() -> dict[str, dict[str, str]]:
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for prev, cur in zip(node.body, node.body[1:], strict=False):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(cur, ast.Expr) and isinstance(cur.value, ast.Constant)
                    and isinstance(cur.value.value, str)):
                fields[prev.target.id] = inspect.cleandoc(cur.value.value)
    return docs


def _doc(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        doc = _field_docs().get(klass.__name__, {}).get(name)
        if doc:
            return doc
    return ""


def describe(section: str | None = None) -> str:
    """Human-readable list of keys (type, default, doc), for one section or the whole tree."""
    lines: list[str] = []

    def walk(cls: type, prefix: str, instance: Any) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                if section is None or key == section or key.startswith(section + ".") \
                        or section.startswith(key + "."):
                    walk(hints[f.name], key + ".", value)
                continue
            if section is not None and not (key == section or key.startswith(section + ".")):
                continue
            type_name = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            lines.append(f"{key}  ({type_name}, default {value!r})")
            doc = _doc(cls, f.name)
            if doc:
                lines.extend("    " + line for line in doc.splitlines())

    walk(SaoConfig, "", SaoConfig())
    if not lines:
        from megatron_sao.config.errors import ConfigError
        from megatron_sao.config.loader import _all_keys

        keys = _all_keys(SaoConfig)
        close = difflib.get_close_matches(section or "", keys, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"; sections: {', '.join(k for k in keys if '.' not in k)}"
        raise ConfigError(f"no config key or section {section!r}{hint}")
    return "\n".join(lines)
