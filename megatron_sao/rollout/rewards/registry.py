"""Reward functions by name or import path, so recipes can choose one in configuration.

`resolve_reward("math")` looks up a registered factory; `resolve_reward("pkg.mod:fn")` imports
`fn`. Keyword arguments configure it: a registered factory is called with them; an imported
object is called with them only if any are given (so "pkg.mod:MyJudge" with kwargs builds a
`MyJudge(**kwargs)`, while "pkg.mod:score" without kwargs is the function itself).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from megatron_sao.config.rollout_names import accept_rollout_name
from megatron_sao.rollout.rewards.answers import exact_match, math_equivalence
from megatron_sao.rollout.rewards.base import RewardFn
from megatron_sao.rollout.rewards.remote import RemoteRewardModel

RewardFactory = Callable[..., RewardFn]
_REGISTRY: dict[str, RewardFactory] = {}


def register_reward(name: str, factory: RewardFactory) -> None:
    """Make `factory(**kwargs) -> RewardFn` available as `name`."""
    if not name or ":" in name:
        raise ValueError(f"reward name must be non-empty and contain no ':', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    _REGISTRY[name] = factory
    accept_rollout_name("rollout.reward", name)  # so that a recipe naming it passes config load


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def _plain(fn: Callable[..., float]) -> RewardFactory:
    """Factory for a module-level function; partial() keeps it picklable for process pools."""

    def factory(**kwargs: Any) -> RewardFn:
        inspect.signature(fn).bind(None, **kwargs)  # TypeError now rather than at the first call
        return functools.partial(fn, **kwargs) if kwargs else fn

    return factory


def resolve_reward(spec: str, **kwargs: Any) -> RewardFn:
    """The reward function named by `spec` (registered name or "module:attribute")."""
    if spec in _REGISTRY:
        try:
            return _REGISTRY[spec](**kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec!r}: bad arguments {sorted(kwargs)}: {e}") from e
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: registered are {registered_rewards()}, "
                         f"or give an import path 'module:function'")
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {spec!r} cannot be imported: {e}") from e
    if kwargs:
        obj = obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable: {obj!r:.80}")
    return obj


register_reward("math", _plain(math_equivalence))
register_reward("exact_match", _plain(exact_match))
register_reward("remote", lambda **kwargs: RemoteRewardModel(**kwargs))
