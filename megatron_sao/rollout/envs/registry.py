"""Environments by name or import path, so recipes can choose one in configuration.

The agent loop takes an `env_factory(sample) -> Environment` and calls it once per trajectory.
`make_env_factory(spec, **kwargs)` builds that factory: `spec` is a registered name (builders
below, imported on first use so that choosing "calc" does not import the sandbox or httpx) or
"module:attribute" naming a builder (called with kwargs), a factory (used as is when no kwargs
are given), or an `Environment` subclass (instantiated with kwargs for every trajectory).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from megatron_sao.config.rollout_names import accept_rollout_name
from megatron_sao.rollout.environment import Environment, PromptSample

EnvFactory = Callable[[PromptSample], Environment]
EnvBuilder = Callable[..., EnvFactory]

_REGISTRY: dict[str, str | EnvBuilder] = {
    "math_python": "megatron_sao.rollout.envs.math_python:make_math_python",
    "calc": "megatron_sao.rollout.envs.calc:make_calc",
    "calc_shift": "megatron_sao.rollout.envs.calc_shift:make_calc_shift",
    "longtail": "megatron_sao.rollout.envs.longtail:make_longtail",
    "subprocess": "megatron_sao.rollout.envs.external:make_subprocess_env",
    "guess_number": "megatron_sao.rollout.envs.external:make_guess_number",
    "openai_scaffold": "megatron_sao.rollout.envs.openai_scaffold:make_openai_scaffold",
}


def register_environment(name: str, builder: EnvBuilder | str) -> None:
    """Make `builder(**kwargs) -> env_factory` (or its "module:attribute" path) available as `name`."""
    if not name or ":" in name:
        raise ValueError(f"environment name must be non-empty and contain no ':', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = builder
    accept_rollout_name("rollout.environment", name)  # so that a recipe naming it passes config load


def registered_environments() -> list[str]:
    return sorted(_REGISTRY)


def _import(path: str, spec: str) -> Any:
    module_name, _, attr_path = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {spec!r} cannot be imported from {path!r}: {e}") from e
    return obj


def make_env_factory(spec: str, **kwargs: Any) -> EnvFactory:
    """The per-trajectory environment factory named by `spec`, configured by `kwargs`."""
    if spec in _REGISTRY:
        entry = _REGISTRY[spec]
        builder = _import(entry, spec) if isinstance(entry, str) else entry
        try:
            return builder(**kwargs)
        except TypeError as e:
            raise ValueError(f"environment {spec!r}: bad arguments {sorted(kwargs)}: {e}") from e
    if ":" not in spec:
        raise ValueError(f"unknown environment {spec!r}: registered are {registered_environments()}, "
                         "or give an import path 'module:attribute'")
    obj = _import(spec, spec)
    if isinstance(obj, type) and issubclass(obj, Environment):
        return lambda sample: obj(**kwargs)
    factory = obj(**kwargs) if kwargs else obj
    if not callable(factory):
        raise ValueError(f"environment {spec!r} is not callable: {factory!r:.80}")
    return factory
