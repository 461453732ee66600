"""A package's public names loaded on first use (PEP 562 module `__getattr__`).

Packages whose submodules pull in heavy dependencies (torch, fastapi, the agent loop) export
their names through this, so a program that imports one light submodule pays for nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """`__getattr__` for `package`: `name` comes from `package.<exports[name]>` when first asked for."""

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return getattr_
