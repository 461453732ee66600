"""Demonstrations of a scripted teacher are recorded exactly as the agent loop records a model."""

from __future__ import annotations

from transformers import AutoTokenizer

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.demonstrations import demonstrations
from megatron_sao.rollout.envs.calc import generate_calc_samples, make_calc, oracle_action
from megatron_sao.rollout.trajectory import TrajectoryStatus


def test_oracle_demonstrations_follow_the_chat_template(tiny_hf_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_dir)
    samples = generate_calc_samples(8, seed=3)
    records = demonstrations(samples, make_calc(), oracle_action, tokenizer, max_turns=3)
    chat = ChatFormat(tokenizer)
    for sample, traj in zip(samples, records, strict=True):
        assert traj.status == TrajectoryStatus.COMPLETED and traj.total_reward == 1.0
        assert len(traj.turns) == 2  # the calculator call, then the answer
        expression, answer = sample.metadata["expression"], sample.answer
        # The whole record is the template's rendering of the conversation, token for token.
        conversation = [*sample.messages, {"role": "assistant", "content": f"<tool_call>{expression}</tool_call>"},
                        {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
        rendered = chat.encode(chat._render(conversation, add_generation_prompt=False))
        assert traj.token_ids == rendered[: len(traj.token_ids)]
        actions = [chat.decode_action(traj.token_ids[t.action_start:t.action_end]) for t in traj.turns]
        assert actions == [f"<tool_call>{expression}</tool_call>", answer]
        assert sum(traj.loss_mask) == sum(t.num_action_tokens for t in traj.turns)
