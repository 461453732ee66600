"""A tool-call format for the random tiny model: every assistant turn is one `bash` call.

A trained model writes its calls in its family's markup (`qwen3`, `glm`: the gateway's
`tool_call_format: auto`). The tiny random MoE of the CPU recipes never writes `<tool_call>{...}`
by chance, so with a real format the example scaffold would never run a tool and the tool path of
the pipeline would go untested. With this format (`tool_call_format:
examples.swe_agent.tiny_tool_format:EveryTurnIsBash`) the gateway hands the
scaffold each turn's whole text as the `command` of a `bash` call, so every turn runs something in
the sandbox (mostly `command not found`). Nothing of the record changes: the trajectory holds the
engine's tokens either way, and `render` gives back exactly the text `parse` consumed.
"""

from __future__ import annotations

from megatron_sao.rollout.gateway.tool_parsers import ParsedCall


class EveryTurnIsBash:
    name = "every_turn_is_bash"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return "", [ParsedCall("bash", {"command": text})]

    def render(self, content: str, calls: list[ParsedCall]) -> str:
        return content + "".join(str(call.arguments.get("command", "")) for call in calls)
