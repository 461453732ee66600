"""R3 routing replay in the trainer: the actor's routers use the experts recorded with the
trajectories (replay on) or their own (replay off, as before replay existed); the critic always
routes itself.

- recorded files: the same trajectories with two different `routed_experts` give two actor losses
  with replay on and one with replay off; the critic's value loss never depends on them;
- a bf16 CPU engine against the fp32 trainer (tiny Qwen3-MoE whose routers are near ties, as
  many experts of a large MoE are: the random tiny model's own margins, >= 0.18, are far above
  bf16's ~0.002 logit error and never flip): the trainer's own routers disagree with the engine's
  on some tokens (`moe/routing_agreement` < 1); with replay every routed token goes to exactly the
  engine's experts and |trainer - engine| log-probs shrink; replay off gives what a trainer
  without routing gives, bit for bit.
(Layouts: test_routing_replay_layouts.py.)
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_sao.platform import run_distributed
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.replay_worker import engine_replay, recorded_losses
from tests.training.trajectories import random_trajectories, with_random_routing


@pytest.mark.slow
def test_recorded_routing_changes_the_actor_loss_only_with_replay(tmp_path, tiny_hf_dir):
    trajectories = random_trajectories(6, seed=21)
    files = {}
    for name, seed in (("a", 1), ("b", 2)):
        files[name] = str(tmp_path / f"{name}.parquet")
        write_parquet(files[name], with_random_routing(trajectories, seed=seed))
    files["none"] = str(tmp_path / "none.parquet")
    write_parquet(files["none"], trajectories)
    m = run_distributed(recorded_losses, 1, str(tiny_hf_dir), files)[0]
    loss = {k: v["actor/loss"] for k, v in m.items()}
    assert abs(loss["a/replay=true"] - loss["b/replay=true"]) > 1e-4 * abs(loss["a/replay=true"])
    assert loss["a/replay=false"] == loss["b/replay=false"] == loss["none/replay=false"]
    # Without recorded routing the replaying actor routes itself: exactly the plain step.
    assert loss["none/replay=true"] == loss["none/replay=false"]
    assert m["none/replay=true"]["moe/replay_missing_frac"] == 1.0
    assert m["a/replay=true"]["moe/replay_missing_frac"] == 0.0  # the last tokens do not count
    assert "moe/routing_agreement" not in m["a/replay=false"]
    # The critic routes itself: its loss is the same whatever the actor replays.
    assert len({v["critic/value_loss"] for v in m.values()}) == 1


NEAR_TIE = 0.01
"""Router rows pulled towards the first: W_e <- W_0 + 0.01 W_e. Router logit margins become a few
1e-3, like bf16's rounding of the router input (without the pull: agreement 1.0)."""
EXPERT_SCALE = 2.0
"""Expert weights x 2 (outputs x 8): the random tiny experts add ~1e-3 to a residual stream of
~1, so which expert a token takes would hardly show in its log-prob. With both, measured on the
fixture's trajectories: agreement 0.968, |trainer - engine| log-prob 0.001447 without replay,
0.001342 with it."""


def near_tie_checkpoint(root: Path) -> Path:
    from safetensors.torch import load_file, save_file

    from tests.rollout.engine_helpers import stoppy_checkpoint

    path = shutil.copytree(stoppy_checkpoint(), root / "near_tie")
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name] = tensors[name][:1] + NEAR_TIE * tensors[name]
    for name in [n for n in tensors if ".mlp.experts." in n]:
        tensors[name] = EXPERT_SCALE * tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def bf16_engine_trajectories(tmp_path_factory):
    """Multi-turn trajectories sampled by a bf16 CPU engine, with its routing."""
    from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
    from megatron_sao.rollout.client import EngineClient
    from megatron_sao.rollout.engine_pool import EnginePool
    from megatron_sao.rollout.routing import routing_spec_from_hf_config
    from tests.rollout.engine_helpers import ScriptedEnv, cpu_engine, sample

    checkpoint = near_tie_checkpoint(tmp_path_factory.mktemp("r3"))
    spec = routing_spec_from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    with cpu_engine(checkpoint, dtype="bfloat16", enable_return_routed_experts=True) as server:
        loop = AgentLoop(AgentLoopConfig(max_turns=3, max_new_tokens_per_turn=40, max_total_tokens=200, routing=spec),
                         AutoTokenizer.from_pretrained(checkpoint), EnginePool([EngineClient(server.url)]),
                         lambda s: ScriptedEnv(done_after=2))
        trajectories = asyncio.run(loop.run([sample(f"p{i}", f"Task {i}: add {i} and 2.") for i in range(6)]))
    for traj in trajectories:
        traj.validate()
    return str(checkpoint), trajectories


def test_replay_makes_the_fp32_trainer_use_the_bf16_engines_experts(bf16_engine_trajectories):
    checkpoint, trajectories = bf16_engine_trajectories
    assert all(t.routed_experts is not None for t in trajectories)
    result = run_distributed(engine_replay, 1, checkpoint, trajectories)[0]
    on, off, plain = result["on"], result["off"], result["plain"]
    # bf16 vs fp32 flips routers: the actor's own choice (before replay) differs on some tokens...
    assert on["moe/routing_agreement"] < 0.99
    # ... replay makes it take the engine's experts on every routed token,
    assert result["engine_experts_used"] == 1.0
    # ... and the trainer's log-probs move closer to the engine's.
    assert on["rollout/logprob_abs_diff_mean"] < off["rollout/logprob_abs_diff_mean"]
    assert on["moe/replay_missing_frac"] == 0.0
    # Replay off is the trainer as it was: the routing in the record changes nothing.
    for key in ("actor/loss", "actor/grad_norm", "rollout/logprob_abs_diff_mean", "critic/value_loss"):
        assert off[key] == plain[key], key
