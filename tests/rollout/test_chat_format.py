"""Token-in / token-out chat rendering: the appended observation tokens are exactly what the chat
template renders for the whole conversation, without ever re-tokenising the model's action."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_sao.rollout.chat_format import ChatFormat
from tests.rollout.engine_helpers import IM_END, tiny_checkpoint

TOKENIZER = AutoTokenizer.from_pretrained(tiny_checkpoint())
text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)


@settings(max_examples=80, deadline=None)
@given(
    user=text,
    turns=st.lists(st.tuples(text, text, st.sampled_from(["tool", "user"])), min_size=1, max_size=3),
)
def test_appended_tokens_equal_the_full_template_rendering(user, turns):
    chat = ChatFormat(TOKENIZER)
    messages = [{"role": "user", "content": user}]
    tokens = chat.encode_prompt(messages)
    for action, observation, role in turns:
        action_ids = [*chat.encode(action), IM_END]  # what the model sampled, closing its turn
        assert chat.decode_action(action_ids) == action
        tokens += action_ids + chat.encode_observation(observation, role, action_ids)
        messages += [{"role": "assistant", "content": action}, {"role": role, "content": observation}]
    rendered = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokens == TOKENIZER.encode(rendered, add_special_tokens=False)


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
