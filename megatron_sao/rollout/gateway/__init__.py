"""The agent gateway: unmodified scaffolds (OpenAI-compatible API) in front of the engine pool,
recorded token-exactly into trajectories (docs/gateway.md).

The names below load on first use: programs a scaffold starts once per tool call or episode
(`sandbox_exec` here, the worked example in the repository's `examples/swe_agent/`) import this
package and must not pay for fastapi and the agent loop (~1.5 s of start-up each) when they import
nothing of it.
"""

from __future__ import annotations

from megatron_sao.utils.lazy_exports import lazy_getattr

_EXPORTS = {
    "ScaffoldRunner": "runner",
    "limits_from": "runner",
    "make_runner": "runner",
    "Gateway": "server",
    "GatewayConfig": "server",
    "GatewaySession": "session",
    "GlmToolFormat": "tool_parsers",
    "ParsedCall": "tool_parsers",
    "Qwen3ToolFormat": "tool_parsers",
    "get_tool_format": "tool_parsers",
    "GatewayError": "types",
    "SessionLimits": "types",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
