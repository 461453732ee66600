"""A recorded trajectory file as the training loop's source (`rollout.source=recorded`, and always for SFT).

Every rank reads the file (`rollout/recorded.py`) and takes the same batch of `data.batch_size`
trajectories per step, wrapping around at the end (`data/epoch` counts the passes); with routing
replay only rank 0 reads the routed experts and sends each rank its part in the train step
(training/routing_shards.py).
"""

from __future__ import annotations

from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.trajectory import Trajectory


class RecordedSource:
    """`training.loop.TrajectorySource` over `data.trajectories_path`."""

    def __init__(self, config: SaoConfig, mode: str = "rl") -> None:
        import torch.distributed as dist

        from megatron_sao.models.build import model_vocab_size
        from megatron_sao.rollout.recorded import RecordedTrajectories
        from megatron_sao.rollout.settings import model_routing_spec, routing_replay_enabled

        replay = mode == "rl" and routing_replay_enabled(config)
        self.data = RecordedTrajectories(config.data.trajectories_path, config.data.batch_size,
                                         routing=model_routing_spec(config) if replay else None,
                                         with_routing=replay and dist.get_rank() == 0,
                                         vocab_size=model_vocab_size(config))

    def describe(self) -> str:
        return f"{len(self.data)} trajectories from {self.data.path} ({self.data.report.summary()})"

    def start(self, trainer: Any) -> None:
        pass

    def next_batch(self, trainer: Any) -> list[Trajectory]:
        return self.data.next_batch()

    def after_step(self, trainer: Any) -> dict[str, float]:
        return {"data/epoch": self.data.epoch}

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)

    def close(self) -> None:
        pass
