"""`training.loop.fit` with a toy trainer and a toy `TrajectorySource` (one process, no model):
the source's batches reach the trainer, the metrics and checkpoints follow the config's cadence,
a SIGTERM ends the loop after a checkpoint of that step, and a source that cannot continue from a
checkpoint names it."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.config import load_config
from megatron_sao.training import loop
from megatron_sao.training.loop import Run, TrajectorySource, fit, resume


@dataclass
class _State:
    step: int = 0


class _ToyTrainer:
    """Records what it trained on and what it saved (the `StepTrainer` calls `fit` makes)."""

    def __init__(self) -> None:
        self.state = _State()
        self.batches: list[list[Any]] = []
        self.saves: list[tuple[int, dict[str, Any], bool]] = []

    def train_step(self, trajectories: Sequence[Any]) -> dict[str, float]:
        self.batches.append(list(trajectories))
        self.state.step += 1
        return {"actor/loss": float(sum(trajectories))}

    def save_checkpoint(self, checkpoints_dir: Path, extra: dict[str, Any] | None = None,
                        final: bool = False) -> Path:
        self.saves.append((self.state.step, dict(extra or {}), final))
        return Path(checkpoints_dir) / f"iter_{self.state.step:07d}"

    def load_checkpoint(self, iter_dir: Path) -> dict[str, Any]:
        self.state.step = int(iter_dir.name.removeprefix("iter_"))
        return {"data": {"position": 9}}


class _CountingSource:
    """Batch k is [k, k]; `stop_after` sends this process a SIGTERM inside that step's batch read."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.position, self.stop_after = 0, stop_after
        self.started = self.closed = False

    def describe(self) -> str:
        return "counting"

    def start(self, trainer: Any) -> None:
        self.started = True

    def next_batch(self, trainer: Any) -> list[Any]:
        assert self.started, "fit must start the source before the first batch"
        self.position += 1
        if self.position == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        return [self.position, self.position]

    def after_step(self, trainer: Any) -> dict[str, float]:
        return {"data/epoch": self.position / 10}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["position"] > 50:
            raise ValueError("position past the end of the data")
        self.position = state["position"]

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def stop_handlers(monkeypatch):
    """The rank's SIGTERM handler (`loop.stop_on_signals`) for the test, restored afterwards."""
    monkeypatch.setattr(loop, "_stop_requested", False)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    loop.stop_on_signals()
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def _config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path}", "run.name=toy", "logging.wandb_mode=disabled",
                              "run.total_steps=5", "checkpoint.save_every=2", *overrides])


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_source_batches_reach_the_trainer_with_the_checkpoint_cadence(tmp_path, stop_handlers):
    config = _config(tmp_path)
    run_dir = tmp_path / "toy"
    run_dir.mkdir()
    trainer, source = _ToyTrainer(), _CountingSource()
    typed: TrajectorySource = source  # the Protocol is structural: a type checker holds this line
    seen: list[int] = []

    def on_step(trainer: Any, metrics: dict[str, float]) -> dict[str, float]:
        seen.append(trainer.state.step)
        return {"eval/hook": 1.0} if trainer.state.step == 5 else {}

    result = fit(trainer, typed, Run(config, run_dir), on_step)
    assert trainer.batches == [[k, k] for k in range(1, 6)]
    assert seen == [1, 2, 3, 4, 5]
    assert result["step"] == 5 and not result["stopped"] and result["metrics"]["eval/hook"] == 1.0
    # Every 2 steps, and the last one (final: synchronous), each with the source's position.
    assert [(s, final) for s, _, final in trainer.saves] == [(2, False), (4, False), (5, True)]
    assert [extra["data"] for _, extra, _ in trainer.saves] == [{"position": 2}, {"position": 4}, {"position": 5}]
    assert trainer.saves[0][1]["config"]["run"]["total_steps"] == 5
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2] == {"step": 3, "actor/loss": 6.0, "data/epoch": 0.3}
    assert source.closed


def test_sigterm_checkpoints_that_step_and_stops(tmp_path, stop_handlers):
    config = _config(tmp_path, "checkpoint.save_every=0")
    run_dir = tmp_path / "toy"
    run_dir.mkdir()
    trainer, source = _ToyTrainer(), _CountingSource(stop_after=3)
    result = fit(trainer, source, Run(config, run_dir))
    assert result["stopped"] and result["step"] == 3
    assert trainer.batches == [[1, 1], [2, 2], [3, 3]]  # the step the signal came in finishes
    assert [(s, final) for s, _, final in trainer.saves] == [(3, True)]
    assert trainer.saves[0][1]["data"] == {"position": 3}
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3]
    assert source.closed


def test_source_closed_when_a_step_raises(tmp_path, stop_handlers):
    config = _config(tmp_path)
    run_dir = tmp_path / "toy"
    run_dir.mkdir()

    class _Failing(_ToyTrainer):
        def train_step(self, trajectories: Sequence[Any]) -> dict[str, float]:
            raise RuntimeError("boom")

    source = _CountingSource()
    with pytest.raises(RuntimeError, match="boom"):
        fit(_Failing(), source, Run(config, run_dir))
    assert source.closed


def test_resume_restores_the_source_and_names_a_checkpoint_it_cannot_continue(tmp_path):
    trainer, source = _ToyTrainer(), _CountingSource()
    assert resume(trainer, source, None) is None and source.position == 0
    assert resume(trainer, source, tmp_path / "iter_0000004") == 4 and source.position == 9
    with pytest.raises(ValueError, match=r"checkpoint .*iter_0000004: position past the end"):

        class _Late(_ToyTrainer):
            def load_checkpoint(self, iter_dir: Path) -> dict[str, Any]:
                super().load_checkpoint(iter_dir)
                return {"data": {"position": 51}}

        resume(_Late(), _CountingSource(), tmp_path / "iter_0000004")


def test_resumed_run_continues_the_metrics_file(tmp_path, stop_handlers):
    config = _config(tmp_path)
    run_dir = tmp_path / "toy"
    run_dir.mkdir()
    # A run stopped after its checkpoint at step 2 but logged step 3 (and half of 4) before it died.
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "act')
    trainer, source = _ToyTrainer(), _CountingSource()
    step = resume(trainer, source, tmp_path / "iter_0000002")
    source.position = 2
    fit(trainer, source, Run(config, run_dir, resume_step=step))
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4, 5]
    assert _rows(run_dir)[2] == {"step": 3, "actor/loss": 6.0, "data/epoch": 0.3}
