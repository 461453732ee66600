"""The agent gateway: unmodified scaffolds (OpenAI-compatible API) in front of the engine pool,
recorded token-exactly into trajectories (docs/gateway.md)."""

from megatron_sao.rollout.gateway.runner import ScaffoldRunner, limits_from, make_runner
from megatron_sao.rollout.gateway.server import Gateway, GatewayConfig
from megatron_sao.rollout.gateway.session import GatewaySession
from megatron_sao.rollout.gateway.tool_parsers import GlmToolFormat, ParsedCall, Qwen3ToolFormat, get_tool_format
from megatron_sao.rollout.gateway.types import GatewayError, SessionLimits

__all__ = [
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "GatewaySession",
    "GlmToolFormat",
    "ParsedCall",
    "Qwen3ToolFormat",
    "ScaffoldRunner",
    "SessionLimits",
    "get_tool_format",
    "limits_from",
    "make_runner",
]
