"""The prompt stream of a run: the dataset's prompts, epoch after epoch, with a resumable position.

Each epoch visits every prompt once, in file order or (`data.shuffle`) in a permutation seeded by
`run.seed` and the epoch number, so the position `(epoch, index)` is the whole state. With
`algorithm.group_size` G > 1 each prompt is handed out G times in a row (GRPO ablations: the
ready buffer releases a group when all G are done). Prompts that were started but not finished
when a checkpoint was written are handed out first after a resume (`pending`), so a preemption
loses none and repeats none. `positioned` numbers each draw (`metadata["stream_position"]`).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_sao.pipeline.buffer import GROUP_ID_KEY
from megatron_sao.rollout.environment import STREAM_POSITION_KEY, PromptSample


class PromptStream(Iterator[PromptSample]):
    def __init__(self, samples: Sequence[PromptSample], shuffle: bool, seed: int, group_size: int = 1,
                 num_epochs: int | None = None) -> None:
        if not samples:
            raise ValueError("the prompt dataset is empty")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.samples = list(samples)
        self.shuffle = shuffle
        self.seed = seed
        self.group_size = group_size
        self.num_epochs = num_epochs
        self.epoch = 0
        self.index = 0  # next position within the epoch's order, in units of samples x group_size
        self.pending: deque[PromptSample] = deque()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __next__(self) -> PromptSample:
        if self.pending:
            return self.pending.popleft()
        if self.index >= len(self._order) * self.group_size:
            if self.num_epochs is not None and self.epoch + 1 >= self.num_epochs:
                raise StopIteration
            self.epoch += 1
            self.index = 0
            self._order = self._epoch_order(self.epoch)
        sample = self.samples[self._order[self.index // self.group_size]]
        self.index += 1
        if self.group_size > 1:  # one group per draw, even when a prompt comes back next epoch
            sample = dataclasses.replace(sample, metadata={**sample.metadata,
                                                           GROUP_ID_KEY: f"{sample.prompt_id}@{self.epoch}"})
        return sample

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.index / (len(self.samples) * self.group_size)

    def state_dict(self, unfinished: Sequence[PromptSample] = ()) -> dict[str, Any]:
        """The position, plus `unfinished` prompts (started, not done) to hand out first on resume."""
        return {"epoch": self.epoch, "index": self.index, "num_samples": len(self.samples),
                "pending": [dataclasses.asdict(s) for s in [*unfinished, *self.pending]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != len(self.samples):
            raise ValueError(f"the prompt dataset has {len(self.samples)} prompts, the checkpoint was written "
                             f"with {state['num_samples']}: resuming would not continue the same stream")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)
        self.pending = deque(PromptSample(**s) for s in state["pending"])


def positioned(stream: PromptStream) -> Iterator[PromptSample]:
    """The stream's prompts, each with its draw number in `metadata["stream_position"]` (0, 1,
    ...; a function of the stream's restorable position, so it survives a resume). Environments
    whose behaviour changes over a run (`calc_shift`, online mode) read it. A prompt handed out
    again after a resume keeps the number it was first drawn with."""
    per_epoch = len(stream.samples) * stream.group_size
    for sample in stream:
        if STREAM_POSITION_KEY not in sample.metadata:
            position = stream.epoch * per_epoch + stream.index - 1
            sample = dataclasses.replace(sample, metadata={**sample.metadata, STREAM_POSITION_KEY: position})
        yield sample
