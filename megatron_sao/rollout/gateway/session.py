"""One episode behind the gateway: the scaffold's requests recorded token by token.

Segments. A scaffold sends its whole conversation every time. When the new request is the
recorded conversation plus new non-assistant messages (tool results, user turns), those messages
are rendered by the chat template and appended as an observation (loss mask 0) and the model
continues the same `Trajectory`. Anything else (an earlier message changed or dropped, a summary
in place of the history, other tools, an assistant message the engine did not sample, the same
history asked again) opens a new segment: a new `Trajectory` whose prompt is the new history
rendered by the template. Nothing recorded is ever re-tokenised. Segment k of an episode carries
`metadata["episode_id"]`, `["segment"] = k` and `["segment_reason"]` (why it was opened: "start",
"history_rewritten: ...", "tools_changed", "regenerated", ...); `GatewaySession.segments` lists them
in order, and the episode's reward is credited by the runner (`gateway/runner.py`).

Requests of one session are served one at a time (a scaffold is one conversation; concurrent
requests in one session would race for the record).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from megatron_sao.rollout.agent_loop import parse_policy_version
from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.client import EngineError, EngineUnavailableError, GenerateOutput, SamplingParams
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.gateway.messages import (
    Message,
    MessageKey,
    RequestError,
    assistant_key,
    message_key,
    template_message,
    template_renders_tool_calls,
)
from megatron_sao.rollout.gateway.rendering import GlueMismatch, observation_tokens
from megatron_sao.rollout.gateway.tool_parsers import ToolCallFormat
from megatron_sao.rollout.gateway.types import GatewayError, Generation, SessionLimits, TurnRequest
from megatron_sao.rollout.trajectory import FinishType, Trajectory


class GatewaySession:
    def __init__(self, session_id: str, prompt_id: str, chat: ChatFormat, pool: EnginePool,
                 tool_format: ToolCallFormat, limits: SessionLimits, metadata: dict[str, Any] | None = None) -> None:
        self.session_id = session_id
        self.prompt_id = prompt_id
        self.chat = chat
        self.pool = pool
        self.tool_format = tool_format
        self.limits = limits
        self.metadata = dict(metadata or {})
        self.segments: list[Trajectory] = []
        self.num_turns = 0
        self.limit_reason: str | None = None
        self.failure: str | None = None
        self.aborted = False
        self.lock = asyncio.Lock()
        self._history: list[frozenset[MessageKey]] = []
        self._tools_key: str | None = None
        self._mode: str | None = None  # "chat" | "completion": the current segment's API
        self._text = ""  # completion mode: the text the current segment stands for
        self._last_answer_at: float | None = None
        self._native_calls = template_renders_tool_calls(chat.tokenizer)

    # ---- chat ---------------------------------------------------------------------------------

    async def chat_turn(self, messages: list[Message], tools: list[dict] | None, request: TurnRequest,
                        parse_calls: bool) -> Generation:
        async with self.lock:
            scaffold_s = self._begin()
            keys = [message_key(m) for m in messages]
            tools_key = json.dumps(tools, sort_keys=True) if tools else None
            traj, reason = self._continues(messages, keys, tools_key)
            if traj is not None:
                try:
                    new = messages[len(self._history):]
                    tail = [template_message(m, self.tool_format, self._native_calls) for m in new]
                    last = traj.turns[-1]
                    obs = observation_tokens(self.chat, traj.token_ids[last.action_start:last.action_end], tail, tools)
                except GlueMismatch as e:
                    traj, reason = None, f"template_mismatch: {e}"
                else:
                    self._check_room(len(traj) + len(obs))
                    traj.append_observation(obs)
            if traj is None:
                rendered = [template_message(m, self.tool_format, self._native_calls) for m in messages]
                try:
                    prompt = self.chat.encode_prompt(rendered, tools)
                except Exception as e:  # jinja's TemplateError and friends: the request's fault
                    raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from e
                traj = self._open_segment(prompt, reason, "chat")
                self._tools_key = tools_key
            self._history = [frozenset([k]) for k in keys] if reason else self._history + [
                frozenset([k]) for k in keys[len(self._history):]]
            out = await self._generate(traj, request, scaffold_s)
            content, calls = self.tool_format.parse(out.text) if parse_calls else (out.text, [])
            self._history.append(frozenset({assistant_key(content, calls), assistant_key(out.text, [])}))
            if calls and out.finish_reason == "stop":
                out.finish_reason = "tool_calls"
            out.content, out.calls = content, calls
            return out

    def _continues(self, messages: list[Message], keys: list[MessageKey],
                   tools_key: str | None) -> tuple[Trajectory | None, str]:
        """(the segment this request appends to, "") or (None, why a new segment opens)."""
        if not self.segments:
            return None, "start"
        if self._mode != "chat":
            return None, "api_changed"
        if tools_key != self._tools_key:
            return None, "tools_changed"
        n = len(self._history)
        for i in range(min(n, len(keys))):
            if keys[i] not in self._history[i]:
                return None, f"history_rewritten: message {i} ({keys[i][0]}) differs from the record"
        if len(keys) == n - 1:  # the last request again (a retry, another sample)
            return None, "regenerated"
        if len(keys) <= n:
            return None, f"history_rewritten: {len(keys)} messages, {n} recorded, nothing new after the last answer"
        for j in range(n, len(keys)):
            if messages[j]["role"] == "assistant":
                return None, f"history_rewritten: assistant message {j} was not sampled here"
        return self.segments[-1], ""

    # ---- completions ----------------------------------------------------------------------------

    async def complete(self, prompt: str | list[int], request: TurnRequest) -> Generation:
        """`/v1/completions`: a prompt that extends the current segment (text, or token ids) appends
        the new part as an observation; any other prompt opens a new segment."""
        async with self.lock:
            scaffold_s = self._begin()
            traj = self.segments[-1] if self.segments and self._mode == "completion" else None
            if isinstance(prompt, str):
                extends = traj is not None and len(prompt) > len(self._text) and prompt.startswith(self._text)
                new_ids = self.chat.encode(prompt[len(self._text):] if extends else prompt)
            else:
                extends = traj is not None and len(prompt) > len(traj) and prompt[: len(traj)] == traj.token_ids
                new_ids = list(prompt[len(traj):]) if extends and traj is not None else list(prompt)
            if extends and traj is not None:
                self._check_room(len(traj) + len(new_ids))
                traj.append_observation(new_ids)
            else:
                traj = self._open_segment(new_ids, "start" if not self.segments else "new_prompt", "completion")
            self._text = (prompt if isinstance(prompt, str) else self.chat.tokenizer.decode(
                traj.token_ids, skip_special_tokens=False))
            out = await self._generate(traj, request, scaffold_s)
            turn = traj.turns[-1]
            action = traj.token_ids[turn.action_start:turn.action_end]
            full = self.chat.tokenizer.decode(action, skip_special_tokens=False)
            self._text += full  # what the segment now stands for; a client echoing `text` back ends here
            cut = full.rindex(out.stop_string) if out.stop_string and out.stop_string in full else len(full)
            out.text = out.content = full[:cut]
            return out

    # ---- shared ---------------------------------------------------------------------------------

    def _begin(self) -> float:
        if self.aborted:
            raise GatewayError(503, "the episode was aborted", "aborted")
        if self.failure:
            raise GatewayError(502, f"the episode already failed: {self.failure}", "engine_error")
        if self.num_turns >= self.limits.max_turns:
            self.limit_reason = self.limit_reason or "max_turns"
            raise GatewayError(400, f"this episode's limit of {self.limits.max_turns} model turns is reached",
                               "max_turns_exceeded")
        return 0.0 if self._last_answer_at is None else time.perf_counter() - self._last_answer_at

    def _check_room(self, length: int) -> None:
        if length >= self.limits.max_total_tokens:
            self.limit_reason = self.limit_reason or "max_total_tokens"
            raise GatewayError(400, f"the conversation needs {length} tokens; the limit is "
                               f"{self.limits.max_total_tokens} (prompt and completion)", "context_length_exceeded")

    def _open_segment(self, prompt_ids: list[int], reason: str, mode: str) -> Trajectory:
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        self._check_room(len(prompt_ids))
        metadata = {**self.metadata, "episode_id": self.session_id, "segment": len(self.segments),
                    "segment_reason": reason, "turn_timings": []}
        traj = Trajectory(prompt_id=self.prompt_id, metadata=metadata)
        traj.timings.started_at = time.time()
        traj.set_prompt(prompt_ids)
        self.segments.append(traj)
        self._mode = mode
        return traj

    async def _generate(self, traj: Trajectory, request: TurnRequest, scaffold_s: float) -> Generation:
        limits = self.limits
        cap = min(request.max_tokens or limits.max_new_tokens_per_turn, limits.max_new_tokens_per_turn)
        start, action_start, n_calls = time.perf_counter(), len(traj), traj.num_engine_calls
        self.num_turns += 1
        out: GenerateOutput | None = None
        while True:
            room = min(limits.max_total_tokens - len(traj), cap - (len(traj) - action_start))
            if out is not None and room <= 0:
                break
            params = SamplingParams(
                max_new_tokens=room, stop=request.stop or None, stop_token_ids=self.chat.stop_token_ids,
                temperature=request.temperature if limits.temperature is None else limits.temperature,
                top_p=request.top_p if limits.top_p is None else limits.top_p,
                skip_special_tokens=False, no_stop_trim=True, sampling_seed=request.seed)
            result = await self._call_engine(traj, params)
            if result is None:
                continue
            out = result
            if out.output_logprobs is None:
                self._fail(traj, "engine_error: the engine returned no log-probs")
            if out.output_ids:
                try:
                    versions = [parse_policy_version(v) for v in out.token_versions()]
                except (ValueError, EngineError) as e:
                    self._fail(traj, f"engine_error: {e}")
                kind = out.finish_reason.type
                finish = FinishType(kind) if kind in FinishType else FinishType.ABORT
                traj.append_action(out.output_ids, out.output_logprobs, versions, finish)
            if out.finish_reason.type == "abort" and not self.chat.ends_with_stop(out.output_ids):
                if self.aborted:
                    raise GatewayError(503, "the episode was aborted", "aborted")
                self._retry(traj, f"engine_abort: {out.finish_reason.message}")
                continue
            if len(traj) == action_start:
                self._fail(traj, f"engine_error: empty answer ({out.finish_reason})")
            break
        assert out is not None
        action = traj.token_ids[action_start:]
        text = self.chat.decode_action(action)
        matched = out.finish_reason.matched
        if isinstance(matched, str) and matched and matched in text:
            text = text[: text.rindex(matched)]
        length = out.finish_reason.type in ("length", "abort")  # abort: resumed until the budget ran out
        generate_s = time.perf_counter() - start
        traj.timings.generate_s += generate_s
        traj.timings.env_s += scaffold_s
        traj.metadata["turn_timings"].append({"turn": len(traj.turns) - 1, "scaffold_s": round(scaffold_s, 6),
                                              "generate_s": round(generate_s, 6), "tokens": len(action),
                                              "engine_calls": traj.num_engine_calls - n_calls})
        self._last_answer_at = time.perf_counter()
        return Generation(text, text, [], "length" if length else "stop", action_start, len(action),
                          len(self.segments) - 1, matched if isinstance(matched, str) and matched else None,
                          action, traj.rollout_logprobs[action_start:])

    async def _call_engine(self, traj: Trajectory, params: SamplingParams) -> GenerateOutput | None:
        async with self.pool.acquire() as client:
            if self.aborted:
                raise GatewayError(503, "the episode was aborted", "aborted")
            rid = f"{self.session_id}-{len(self.segments) - 1}-{traj.num_engine_calls}"
            traj.num_engine_calls += 1
            try:
                return await client.generate(traj.token_ids, params, rid=rid)
            except EngineUnavailableError as e:
                await self.pool.mark_unhealthy(client)
                self._retry(traj, f"engine_unavailable: {e.message}")
                return None
            except EngineError as e:
                self._fail(traj, f"engine_error: {e.message}")
        return None  # unreachable: _fail raises

    def _retry(self, traj: Trajectory, reason: str) -> None:
        traj.num_engine_retries += 1
        if traj.num_engine_retries > self.limits.max_engine_retries:
            self._fail(traj, f"engine_retries_exhausted: {reason}")

    def _fail(self, traj: Trajectory, reason: str) -> None:
        self.failure = reason
        raise GatewayError(502, reason, "engine_error")

    def abort(self) -> None:
        self.aborted = True
