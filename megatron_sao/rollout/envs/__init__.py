"""Shipped environments and their registry.

| name | module | what |
|---|---|---|
| `math_python` | `math_python` | math with a sandboxed Python tool, boxed answer checked for equivalence (TIR) |
| `calc` | `calc` | tiny synthetic calculator task for the CPU demo (graded reward, oracle, generator) |
| `longtail` | `longtail` | benchmark episodes whose turn counts follow a seeded lognormal (`tools/bench_async.py`) |
| `subprocess` | `external` | adapter for an external environment process (line-delimited JSON protocol) |
| `guess_number` | `external`, `guess_number` | worked example of an external environment |

Tool-call syntax: `tool_calls.py`. Choosing one: `make_env_factory("math_python", timeout_s=5)`.
"""

from megatron_sao.rollout.envs.registry import (
    EnvFactory,
    make_env_factory,
    register_environment,
    registered_environments,
)

__all__ = ["EnvFactory", "make_env_factory", "register_environment", "registered_environments"]
