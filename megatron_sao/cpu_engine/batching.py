"""Batching helpers of the CPU engine's scheduler: prefill grouping by length, and counters."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.cpu_engine.request import EngineRequest


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_prefills: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0


def length_groups(requests: list[EngineRequest], max_waste: float = 0.5) -> list[list[EngineRequest]]:
    """Split length-sorted requests into prefill groups whose left padding wastes at most
    `max_waste` of the group's tokens."""
    groups: list[list[EngineRequest]] = []
    current: list[EngineRequest] = []
    total = 0
    for req in requests:
        n = len(req.input_ids) + len(req.output_ids)
        if current and n * (len(current) + 1) > (1.0 + max_waste) * (total + n) + 64:
            groups.append(current)
            current, total = [], 0
        current.append(req)
        total += n
    if current:
        groups.append(current)
    return groups
