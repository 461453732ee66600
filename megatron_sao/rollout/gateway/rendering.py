"""Token-exact rendering of what a scaffold adds between two model turns.

Single messages after a turn the model closed with its stop token use `ChatFormat.encode_observation`
(the agent loop's own glue, so both producers of trajectories agree). Several messages at once
(parallel tool results, a tool result and a user nudge) are rendered together, because templates
group them (Qwen3 wraps consecutive tool messages into one `user` block): the conversation
`[user S1, assistant S2, *new messages]` is rendered with the generation prompt and the text after
S2 is taken; the model's stop token opens that text and is already in the record, so it is taken
off. A turn that did not end with the stop token (a `length` finish, a stop string) is closed by
the template's own text (loss mask 0, as every observation token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_sao.rollout.chat_format import ChatFormat, Tools

_S1, _S2 = "SAOGATEWAYUSERQ7", "SAOGATEWAYACTIONQ7"


class GlueMismatch(ValueError):
    """The template does not continue the recorded turn the way the model closed it."""


def observation_tokens(chat: ChatFormat, action_ids: Sequence[int], messages: list[dict[str, Any]],
                       tools: Tools) -> list[int]:
    """Tokens to append after the recorded action `action_ids` for the template `messages`, ending
    with the opening of the next assistant turn. Raises `GlueMismatch` when the template disagrees."""
    closed = chat.ends_with_stop(action_ids)
    if closed and len(messages) == 1 and set(messages[0]) == {"role", "content"}:
        try:
            return chat.encode_observation(messages[0]["content"], messages[0]["role"], action_ids, tools)
        except ValueError as e:
            raise GlueMismatch(str(e)) from e
    conversation = [{"role": "user", "content": _S1}, {"role": "assistant", "content": _S2}, *messages]
    extra = {} if tools is None else {"tools": tools}
    try:
        text = chat.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # a template that refuses this continuation (role order, ...): not appendable
        raise GlueMismatch(f"the chat template cannot render the new messages after a turn: {e}") from e
    if text.count(_S2) != 1:
        raise GlueMismatch("the chat template does not render the assistant turn verbatim")
    after = text[text.index(_S2) + len(_S2) :]
    if closed:
        stop_text = chat.tokenizer.decode([int(action_ids[-1])], skip_special_tokens=False)
        if not after.startswith(stop_text):
            raise GlueMismatch(f"the template closes the turn with {after[:40]!r}, the model with {stop_text!r}")
        after = after[len(stop_text) :]
    return chat.encode(after)
