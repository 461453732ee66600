"""The names a recipe may give `rollout.environment` and `rollout.reward`, checked when a config
loads so that a misspelt name fails before any process starts, not an hour into a run.

The rollout package owns what the names mean (`rollout/envs/registry.py`,
`rollout/rewards/registry.py`); config sits below it and imports nothing above, so the names are
declared here and the registries keep them equal: a test checks that the shipped names match, and
`register_environment` / `register_reward` add a name registered at run time with
`accept_rollout_name` (a downward call). A name with a ':' is an import path `module:attribute`,
resolved by the rollout package when the run builds its environment.
"""

from __future__ import annotations

from megatron_sao.config.errors import ConfigError

_ACCEPTED: dict[str, set[str]] = {
    "rollout.environment": {"calc", "calc_shift", "guess_number", "longtail", "math_python", "openai_scaffold",
                            "subprocess"},
    "rollout.reward": {"exact_match", "math", "remote"},
}


def accepted_rollout_names(key: str) -> list[str]:
    """The registered names `key` ("rollout.environment" or "rollout.reward") accepts, sorted."""
    return sorted(_ACCEPTED[key])


def accept_rollout_name(key: str, name: str) -> None:
    """Accept `name` for `key` from now on (called by the rollout registries on registration)."""
    _ACCEPTED[key].add(name)


def check_rollout_name(key: str, name: str, source: str) -> None:
    """ConfigError naming `key` unless `name` is registered or an import path."""
    if name not in _ACCEPTED[key] and ":" not in name:
        raise ConfigError(f"{key}: unknown name {name!r}; registered: {', '.join(accepted_rollout_names(key))}, "
                          f"or an import path 'module:attribute' (in {source})")
