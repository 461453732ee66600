"""Token-in / token-out chat rendering: the appended observation tokens are exactly what the chat
template renders for the whole conversation, without ever re-tokenising the model's action."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_sao.rollout.chat_format import ChatFormat
from tests.rollout.engine_helpers import IM_END, tiny_checkpoint, tools_tokenizer

TOKENIZER = AutoTokenizer.from_pretrained(tiny_checkpoint())
TOOLS_TOKENIZER = tools_tokenizer()
CODE = {"type": "object", "properties": {"code": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python.", "parameters": CODE}}]
text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)


@settings(max_examples=80, deadline=None)
@given(
    user=text,
    turns=st.lists(st.tuples(text, text, st.sampled_from(["tool", "user"])), min_size=1, max_size=3),
    tools=st.sampled_from([None, TOOLS]),
)
def test_appended_tokens_equal_the_full_template_rendering(user, turns, tools):
    """With the tools template too: the tools open the prompt, and tool observations (whose
    rendering depends on the tools) still match the full rendering."""
    tokenizer = TOKENIZER if tools is None else TOOLS_TOKENIZER
    chat = ChatFormat(tokenizer)
    messages = [{"role": "user", "content": user}]
    tokens = chat.encode_prompt(messages, tools)
    for action, observation, role in turns:
        action_ids = [*chat.encode(action), IM_END]  # what the model sampled, closing its turn
        assert chat.decode_action(action_ids) == action
        tokens += action_ids + chat.encode_observation(observation, role, action_ids, tools)
        messages += [{"role": "assistant", "content": action}, {"role": role, "content": observation}]
    extra = {} if tools is None else {"tools": tools}
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    assert tokens == tokenizer.encode(rendered, add_special_tokens=False)


def test_declared_tools_reach_the_prompt_tokens():
    chat = ChatFormat(TOOLS_TOKENIZER)
    messages = [{"role": "user", "content": "2+2?"}]
    plain = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    with_tools = TOOLS_TOKENIZER.decode(chat.encode_prompt(messages, TOOLS))
    assert with_tools == f"<|im_start|>system\n# Tools\n{json.dumps(TOOLS[0])}\n<|im_end|>\n{plain}"
    assert TOOLS_TOKENIZER.decode(chat.encode_prompt(messages)) == plain
    # the glue of a tool observation follows the tools too (cached per tool set, not shared)
    action = [*chat.encode("x"), IM_END]
    observation = TOOLS_TOKENIZER.decode(chat.encode_observation("4", "tool", action, TOOLS))
    assert observation.startswith("\n<|im_start|>tool\n<tool_response>4</tool_response><|im_end|>")
    observation = TOOLS_TOKENIZER.decode(chat.encode_observation("4", "tool", action))
    assert observation.startswith("\n<|im_start|>tool\n4<|im_end|>")


class _NoToolsTokenizer:
    """A tokenizer-like object whose apply_chat_template has no `tools` argument."""

    eos_token_id = IM_END

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return TOKENIZER.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt)

    def encode(self, text, add_special_tokens):
        return TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def test_no_tools_means_the_template_is_called_as_before():
    messages = [{"role": "user", "content": "hi"}]
    assert ChatFormat(_NoToolsTokenizer()).encode_prompt(messages) == ChatFormat(TOKENIZER).encode_prompt(messages)


def test_special_tool_markup_survives_decoding():
    chat = ChatFormat(TOKENIZER)
    ids = [*chat.encode("<tool_call>{}</tool_call>"), IM_END]
    assert chat.decode_action(ids) == "<tool_call>{}</tool_call>"


def test_refusals():
    chat = ChatFormat(TOKENIZER)
    with pytest.raises(ValueError, match="stop token"):
        chat.encode_observation("x", "tool", chat.encode("unfinished"))
    with pytest.raises(ValueError, match="no messages"):
        chat.encode_prompt([])
    wrong_stop = ChatFormat(TOKENIZER, stop_token_ids=[chat.encode("a")[0]])
    with pytest.raises(ValueError, match="stop_token_ids"):
        wrong_stop.encode_observation("x", "tool", chat.encode("a"))
