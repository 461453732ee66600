"""Token-in / token-out chat rendering for multi-turn rollouts.

The trajectory is built by appending token ids, never by re-rendering the conversation: the
model's own sampled tokens stay exactly as sampled (re-tokenising decoded text can split them
differently and would misalign the log-probs), and templates that rewrite history (Qwen3 drops
old `<think>` blocks) cannot change tokens already in the record.

What the chat template contributes between turns is computed once per observation role from a
rendering with sentinel contents: for `[user S1, assistant S2, <role> S3]` with a generation
prompt, the text between S2 and S3 is the glue that closes the assistant turn and opens the
observation (`<|im_end|>\\n<|im_start|>tool\\n` for Qwen-style templates), and the text after S3
closes the observation and opens the next assistant turn (`<|im_end|>\\n<|im_start|>assistant\\n`).
The assistant turn was closed by the model itself when it sampled its stop token, so that token's
text is taken off the front of the glue (`\\n<|im_start|>tool\\n` remains).

Tools an environment declares (OpenAI-style JSON schemas) are passed to every rendering, the glue
included: templates put them in the system prompt, and one that also renders later turns
differently when tools are declared still gets glue that matches its full rendering.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Tools = list[dict[str, Any]] | None

_S1, _S2, _S3 = "SAOSENTINELUSERQ7", "SAOSENTINELACTIONQ7", "SAOSENTINELOBSERVATIONQ7"


class ChatFormat:
    def __init__(self, tokenizer, stop_token_ids: Sequence[int] | None = None) -> None:
        """`stop_token_ids`: tokens that end an assistant turn; default the tokenizer's EOS
        (`<|im_end|>` for Qwen-style tokenizers)."""
        self.tokenizer = tokenizer
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids explicitly")
            stop_token_ids = [int(tokenizer.eos_token_id)]
        if not stop_token_ids:
            raise ValueError("stop_token_ids cannot be empty")
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._glue: dict[tuple[str, int, str | None], tuple[str, str]] = {}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool, tools: Tools = None) -> str:
        # `tools` only when given: a tokenizer-like object without tool support keeps working.
        extra = {} if tools is None else {"tools": tools}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, messages: list[dict[str, str]], tools: Tools = None) -> list[int]:
        """The prompt messages rendered with the generation prompt (ends with the opening of the
        first assistant turn), declaring `tools` (JSON schemas) when given."""
        if not messages:
            raise ValueError("the prompt has no messages")
        return self.encode(self._render(messages, add_generation_prompt=True, tools=tools))

    def ends_with_stop(self, action_ids: Sequence[int]) -> bool:
        return bool(action_ids) and action_ids[-1] in self.stop_token_ids

    def decode_action(self, action_ids: Sequence[int]) -> str:
        """The text the environment sees: the action without its closing stop token. Special
        tokens are kept (tool-call markup such as `<tool_call>` can be a special token)."""
        ids = list(action_ids[:-1] if self.ends_with_stop(action_ids) else action_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def glue(self, role: str, stop_token_id: int, tools: Tools = None) -> tuple[str, str]:
        """(text before, text after) an observation of `role`, following an action that ended
        with `stop_token_id`, in a conversation that declares `tools`."""
        key = (role, stop_token_id, None if tools is None else json.dumps(tools, sort_keys=True))
        if key not in self._glue:
            messages = [
                {"role": "user", "content": _S1},
                {"role": "assistant", "content": _S2},
                {"role": role, "content": _S3},
            ]
            text = self._render(messages, add_generation_prompt=True, tools=tools)
            if text.count(_S2) != 1 or text.count(_S3) != 1:
                raise ValueError(f"the chat template does not render a {role!r} message after an assistant turn")
            before = text[text.index(_S2) + len(_S2) : text.index(_S3)]
            after = text[text.index(_S3) + len(_S3) :]
            stop_text = self.tokenizer.decode([stop_token_id], skip_special_tokens=False)
            if not before.startswith(stop_text):
                raise ValueError(
                    f"the chat template closes an assistant turn with {before[:40]!r}, not with the stop token "
                    f"{stop_text!r} the model sampled; set the agent loop's stop_token_ids to match the template"
                )
            self._glue[key] = (before[len(stop_text) :], after)
        return self._glue[key]

    def encode_observation(self, content: str, role: str, action_ids: Sequence[int], tools: Tools = None) -> list[int]:
        """Tokens appended after an action that ended with a stop token: the template's glue, the
        observation, and the opening of the next assistant turn (`tools`: those of the prompt)."""
        if not self.ends_with_stop(action_ids):
            raise ValueError("an observation can only follow an action that ended with a stop token")
        before, after = self.glue(role, int(action_ids[-1]), tools)
        return self.encode(before + content + after)
