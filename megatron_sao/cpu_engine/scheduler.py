"""The CPU engine's scheduler: continuous batching on one thread that owns the model.

Every request joins a FIFO waiting queue. Between decode steps the scheduler admits waiting
requests (a length-grouped, left-padded prefill, bounded by `max_prefill_tokens`), merges them
into the running batch, runs one decode step for all running rows, and answers the rows that
finished. Control operations (abort, pause / continue, weight updates, flush) are closures queued
to the same thread and run between steps, so the model is never touched concurrently and a weight
update lands on a step boundary: requests in flight continue with their cached KV under the new
weights and their later tokens carry the new version (SGLang's `pause_generation(in_place)` ->
update -> `continue_generation` behaviour, recorded per token in `weight_versions` spans).
What one step does with the model's logits (prompt log-probs, penalties, sampling) is steps.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from megatron_sao.cpu_engine.batching import SchedulerStats, length_groups
from megatron_sao.cpu_engine.kv_cache import RowKVCache
from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.cpu_engine.occupation import EngineFatal, MemoryOccupation
from megatron_sao.cpu_engine.request import EngineRequest, abort_reason
from megatron_sao.cpu_engine.routing_capture import RoutingRecord
from megatron_sao.cpu_engine.sampling import BatchSamplingParams
from megatron_sao.cpu_engine.steps import needs_prefill, prefill, record_routing, sample
from megatron_sao.cpu_engine.stops import finish_reason
from megatron_sao.cpu_engine.weights import HFWeightMap

logger = logging.getLogger(__name__)
T = TypeVar("T")
PauseMode = Literal["abort", "retract", "in_place"]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        max_running_requests: int = 64,
        max_prefill_tokens: int = 16384,
        weight_version: str = "default",
        seed: int = 0,
        return_original_logprob: bool = False,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.runner = runner
        self.weight_map = HFWeightMap(runner.model)
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.return_original_logprob = return_original_logprob
        self.global_generator = torch.Generator().manual_seed(seed)
        self.stats = SchedulerStats()
        self.paused = False
        self.memory = MemoryOccupation()
        self.fatal_error: str | None = None
        """Why the engine stopped itself (an operation SGLang 0.5.23 crashes on, occupation.py)."""
        self.on_fatal: Callable[[], None] | None = None
        """Called (from the scheduler thread) once a fatal error stopped the loop: the server exits."""
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._admitting: list[EngineRequest] = []
        self._cache: RowKVCache | None = None
        self._positions = torch.zeros(0, dtype=torch.long)  # [B] position of each row's pending token
        self._pending = torch.zeros(0, dtype=torch.long)  # [B] last sampled token, not yet cached
        self._params: BatchSamplingParams | None = None
        self._rids: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)
        self.last_progress = time.monotonic()
        self.step_started = self.last_progress

    # ---- thread-safe API ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after its current step (safe from a signal handler: no waiting).
        The loop then fails every request it holds, so no caller waits for an answer forever."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._fail_everything()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the scheduler thread between steps; its result or exception lands in the
        returned future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError("the CPU engine scheduler is not running"))
            return future
        self._commands.put((fn, future))
        return future

    def submit(self, request: EngineRequest) -> concurrent.futures.Future:
        """Queue a request; its future resolves to the finished request."""
        self.call(lambda: self._add(request)).add_done_callback(
            lambda f: request.fail(f.exception()) if f.exception() else None
        )
        return request.future

    # ---- control operations (run on the scheduler thread via call()) -------------------------

    def _add(self, request: EngineRequest) -> None:
        if request.rid in self._rids:
            raise ValueError(f"duplicate request id {request.rid!r}")
        if not needs_prefill(request):
            request.finish({"type": "length", "length": 0})
            return
        capture = self.runner.routing
        if request.routed_experts_start_len is not None and capture is not None and request.routing is None:
            request.routing = RoutingRecord(capture.num_layers, capture.topk)
        self._rids.add(request.rid)
        self._waiting.append(request)

    def abort(self, rid: str | None = None, abort_all: bool = False, exact: bool = False, message: str = "") -> int:
        """Finish matching requests with finish_reason abort (partial output kept). SGLang
        matches `rid` as a prefix of request ids; `exact` matches it exactly. Scheduler thread."""
        if not abort_all and not rid:
            raise ValueError("abort needs a rid or abort_all=true")

        def matches(req: EngineRequest) -> bool:
            return abort_all or (req.rid == rid if exact else req.rid.startswith(rid or ""))

        count = 0
        for req in [r for r in self._waiting if matches(r)]:
            self._waiting.remove(req)
            self._finish(req, abort_reason(message or "Abort in waiting queue"))
            count += 1
        keep = [i for i, r in enumerate(self._running) if not matches(r)]
        for req in self._running:
            if not matches(req):
                continue
            self._finish(req, abort_reason(message or "Abort requested"))
            count += 1
        self._keep_rows(keep)
        self.stats.aborted_requests += count
        return count

    def pause(self, mode: PauseMode) -> None:
        """Scheduler thread. `abort`: abort everything; `retract`: running requests go back to
        the queue and will be re-prefilled (cache dropped); `in_place`: keep everything."""
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        elif mode == "retract":
            for req in reversed(self._running):
                self._waiting.appendleft(req)
            self._keep_rows([])
        elif mode != "in_place":
            raise ValueError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def apply_weights(self, named: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Scheduler thread: copy HF-named tensors into the model, then bump the version."""
        self.memory.check_weight_load()
        self.weight_map.copy_(named)
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def fully_idle(self) -> bool:
        """SGLang 0.5.23's `is_fully_idle(ignore_waiting=paused)` (what flush_cache, the cache flush
        after a weight update and release_memory_occupation require): nothing running, and nothing
        waiting unless generation is paused (retracted requests wait in the queue)."""
        return not self._running and not self._admitting and (self.paused or not self._waiting)

    def release_memory(self, tags: list[str] | None) -> list[str]:
        """Scheduler thread: `release_memory_occupation` (occupation.py: fatal unless idle)."""
        return self.memory.release(tags, self.fully_idle())

    def resume_memory(self, tags: list[str] | None) -> list[str]:
        return self.memory.resume(tags)

    def busy(self) -> bool:
        """Work in flight (read from other threads: a stale answer is harmless, it only decides
        whether a health probe must be queued)."""
        return bool(self._waiting or self._running or self._admitting)

    def stepping_within(self, within_s: float) -> bool:
        """A step finished, or the current one started, within `within_s`: the loop is not stuck."""
        return time.monotonic() - max(self.last_progress, self.step_started) < within_s

    def load(self) -> dict[str, int]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                has_work = not self.paused and bool(self._waiting or self._running)
                self._drain_commands(block=not has_work)
                if self._stop.is_set() or self.paused or not (self._waiting or self._running):
                    continue
                try:
                    self.memory.check_step()
                except EngineFatal as e:
                    self._die(e)
                    continue
                self.step_started = time.monotonic()
                self._admit()
                if self._running:
                    try:
                        self._decode_step()
                    except Exception as e:  # the batch's cache is suspect: recompute the rows
                        self._retract_after_failure(e)
                self.last_progress = time.monotonic()
        finally:
            self._fail_everything()

    def _die(self, error: EngineFatal) -> None:
        """Stop the loop as SGLang's scheduler stops on an exception (the server goes with it)."""
        logger.error("CPU engine: fatal: %s; stopping (as SGLang's scheduler would)", error)
        self.fatal_error = str(error)
        self._stop.set()
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_everything(self) -> None:
        """Answer every request still held or queued (the loop has ended)."""
        error = RuntimeError(f"the CPU engine stopped: {self.fatal_error}" if self.fatal_error
                             else "the CPU engine is shutting down")
        for req in [*self._waiting, *self._running, *self._admitting]:
            req.fail(error)
        self._waiting.clear()
        self._running, self._admitting = [], []
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _fail_request(self, req: EngineRequest, error: BaseException) -> None:
        """Finish one request with an abort answer that says why; the others carry on."""
        logger.error("CPU engine: request %s failed: %r", req.rid, error)
        self._finish(req, abort_reason(f"engine error while serving this request: {error!r}", status_code=500))
        self.stats.failed_requests += 1

    def _retract_after_failure(self, error: Exception) -> None:
        """A decode step failed: its rows go back to the waiting queue (their output so far is kept
        and re-prefilled). A request in two failed steps is failed alone, so a request that breaks
        every batch it joins cannot keep the others from finishing."""
        logger.exception("CPU engine decode step failed; re-prefilling its %d rows", len(self._running))
        rows = list(self._running)
        self._keep_rows([])
        for req in reversed(rows):
            req.failures += 1
            if req.failures >= 2:
                self._fail_request(req, error)
            else:
                self._waiting.appendleft(req)

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except EngineFatal as e:
                    future.set_exception(e)
                    self._die(e)
                    return
                except Exception as e:
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        free = self.max_running_requests - len(self._running)
        chosen: list[EngineRequest] = []
        tokens = 0
        while self._waiting and len(chosen) < free:
            n = len(self._waiting[0].input_ids) + len(self._waiting[0].output_ids)
            if chosen and tokens + n > self.max_prefill_tokens:
                break
            chosen.append(self._waiting.popleft())
            tokens += n
        if not chosen:
            return
        chosen.sort(key=lambda r: len(r.input_ids) + len(r.output_ids))
        self._admitting = chosen  # in no queue while prefilled: _fail_everything must still see them
        for group in length_groups(chosen):
            self._prefill_isolated(group)
        self._admitting = []

    def _prefill_isolated(self, group: list[EngineRequest]) -> None:
        """Prefill `group`; if that fails, prefill each request alone, failing only the ones that
        fail alone (each prefill builds its own cache, so a failed one leaves nothing behind)."""
        try:
            self._prefill(group)
            return
        except Exception as e:
            if len(group) == 1:
                self._fail_request(group[0], e)
                return
            logger.warning("CPU engine prefill of %d requests failed (%r); retrying them one by one", len(group), e)
        for req in group:
            try:
                self._prefill([req])
            except Exception as e:
                self._fail_request(req, e)

    def _prefill(self, group: list[EngineRequest]) -> None:
        cache, logits = prefill(self.runner, group)
        num_rows = len(group)
        self.stats.num_prefills += 1
        self.stats.prefill_tokens += sum(len(r.input_ids) + len(r.output_ids) for r in group)
        live = []
        for i, req in enumerate(group):
            if len(req.output_ids) >= req.max_new_tokens:  # a prompt-only request (max_new_tokens 0)
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                live.append(i)
        if len(live) < len(group):
            group, logits = [group[i] for i in live], logits[live]
        if not group:
            return
        params = BatchSamplingParams.build([r.sampling for r in group])
        tokens, logprobs = self._sample(logits, params, group)
        keep = self._append_and_check(group, tokens, logprobs)
        if not keep:
            return
        if len(keep) < num_rows:  # rows of the prefilled batch (finished ones dropped)
            cache.select_rows([live[i] for i in keep])
        kept = [group[i] for i in keep]
        positions = torch.tensor([len(r.input_ids) + len(r.output_ids) - 1 for r in kept], dtype=torch.long)
        if self._cache is None or not self._running:
            self._cache = cache
        else:
            self._cache.merge(cache)
        self._running.extend(kept)
        self._positions = torch.cat([self._positions, positions])
        self._pending = torch.cat([self._pending, tokens[keep]])
        self._params = None

    def _decode_step(self) -> None:
        assert self._cache is not None
        logits = self.runner.decode(self._cache, self._pending, self._positions)
        if self.runner.routing is not None:
            record_routing(self.runner, self._running, self._positions.tolist(), [1] * len(self._running))
        self._positions = self._positions + 1
        if self._params is None:
            self._params = BatchSamplingParams.build([r.sampling for r in self._running])
        tokens, logprobs = self._sample(logits, self._params, self._running)
        self.stats.num_steps += 1
        self._pending = tokens
        keep = self._append_and_check(self._running, tokens, logprobs)
        if len(keep) < len(self._running):
            self._keep_rows(keep)

    def _sample(
        self, logits: torch.Tensor, params: BatchSamplingParams, requests: list[EngineRequest]
    ) -> tuple[torch.Tensor, list[float | BaseException]]:
        return sample(logits, params, requests, self.runner.eos_token_ids, self.global_generator,
                      self.return_original_logprob)

    def _append_and_check(
        self, requests: list[EngineRequest], tokens: torch.Tensor, logprobs: list[float | BaseException]
    ) -> list[int]:
        """Record one sampled token per request; finish the ones that are done (or failed).
        Returns the indices of the requests that continue."""
        keep = []
        version = self.weight_version
        token_list = tokens.tolist()
        for i, req in enumerate(requests):
            if isinstance(logprobs[i], BaseException):
                self._fail_request(req, logprobs[i])  # type: ignore[arg-type]
                continue
            req.append(token_list[i], logprobs[i], version)  # type: ignore[arg-type]
            reason = finish_reason(req, self.runner.eos_token_ids, self.runner.tokenizer)
            if reason is None:
                keep.append(i)
            else:
                self._finish(req, reason)
        self.stats.generated_tokens += len(requests)
        return keep

    def _finish(self, req: EngineRequest, reason: dict[str, Any]) -> None:
        self._rids.discard(req.rid)
        self.stats.finished_requests += 1
        req.finish(reason)

    def _keep_rows(self, keep: list[int]) -> None:
        """Shrink the running batch to the rows `keep` (indices into the current batch)."""
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        self._params = None
        if not keep:
            self._cache = None
            self._positions = torch.zeros(0, dtype=torch.long)
            self._pending = torch.zeros(0, dtype=torch.long)
            return
        assert self._cache is not None
        self._cache.select_rows(keep)
        self._cache.drop_unused_left_columns()
        self._positions = self._positions[keep]
        self._pending = self._pending[keep]
