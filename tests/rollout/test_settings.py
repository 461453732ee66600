from __future__ import annotations

from pathlib import Path

from megatron_sao.config import load_config
from megatron_sao.rollout.settings import agent_loop_config_from, engine_config_from

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"


def test_rollout_settings_follow_the_run_config():
    cfg = load_config(TINY, ["rollout.num_engines=3", "rollout.max_inflight_per_engine=5", "rollout.sglang.tensor=4",
                             "rollout.sglang.extra_args=[--enable-metrics]", "rollout.temperature=0.7",
                             "rollout.max_turns=5", "rollout.max_new_tokens_per_turn=48"])
    engine = engine_config_from(cfg)
    assert (engine.backend, engine.num_engines, engine.tp_size) == ("cpu", 3, 4)
    assert engine.model_path == cfg.model.hf_path and engine.context_length == cfg.rollout.max_total_tokens
    assert engine.extra_args == ["--enable-metrics"] and engine.random_seed == cfg.run.seed
    assert engine_config_from(cfg, model_path="/ckpt/step_10/hf").model_path == "/ckpt/step_10/hf"
    loop = agent_loop_config_from(cfg)
    assert (loop.max_turns, loop.max_new_tokens_per_turn, loop.temperature) == (5, 48, 0.7)
    assert loop.max_concurrent_trajectories == 15


def test_environment_and_reward_names_are_checked_at_load():
    import pytest

    from megatron_sao.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.environment: unknown name 'synthetic_tool'; registered: calc"):
        load_config(TINY, ["rollout.environment=synthetic_tool"])
    with pytest.raises(ConfigError, match=r"rollout.reward: unknown name 'math_equivalence'; registered: exact_match"):
        load_config(TINY, ["rollout.reward=math_equivalence"])
    assert load_config(TINY, ["rollout.environment=mypkg.envs:make_env"]).rollout.environment == "mypkg.envs:make_env"


def test_config_refuses_unknown_names_without_the_rollout_package():
    """config imports nothing above it: the refusal runs when only the config package is loaded."""
    import subprocess
    import sys

    code = ("import sys; from megatron_sao.config import ConfigError, load_config\n"
            "try:\n    load_config(sys.argv[1], ['rollout.environment=synthetic_tool'])\n"
            "except ConfigError as e:\n    print(e)\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatron_sao.rollout')))")
    out = subprocess.run([sys.executable, "-c", code, str(TINY)], capture_output=True, text=True, check=True).stdout
    assert "rollout.environment: unknown name 'synthetic_tool'" in out and out.endswith("[]\n"), out


def test_registries_keep_the_names_config_accepts(monkeypatch):
    """The shipped names config declares are the registered ones, and a name registered at run time
    (`register_environment`, `register_reward`) passes config load."""
    from megatron_sao.config import rollout_names
    from megatron_sao.rollout.envs import registry as envs
    from megatron_sao.rollout.rewards import registry as rewards
    from megatron_sao.rollout.rewards.answers import exact_match

    assert envs.registered_environments() == rollout_names.accepted_rollout_names("rollout.environment")
    assert rewards.registered_rewards() == rollout_names.accepted_rollout_names("rollout.reward")
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))
    monkeypatch.setattr(rollout_names, "_ACCEPTED", {k: set(v) for k, v in rollout_names._ACCEPTED.items()})
    envs.register_environment("my_task", "megatron_sao.rollout.envs.calc:make_calc")
    rewards.register_reward("my_reward", lambda: exact_match)
    cfg = load_config(TINY, ["rollout.environment=my_task", "rollout.reward=my_reward"])
    assert (cfg.rollout.environment, cfg.rollout.reward) == ("my_task", "my_reward")


def test_environment_options_are_derived_once():
    from megatron_sao.rollout.settings import env_factory_from, environment_kwargs_from

    cfg = load_config(TINY, ["rollout.environment=math_python", "rollout.tool_timeout_s=3",
                             "rollout.tool_memory_mb=512", "rollout.reward=exact_match"])
    assert environment_kwargs_from(cfg) == {"reward": "exact_match", "timeout_s": 3.0, "memory_mb": 512}
    cfg = load_config(TINY, ["rollout.environment=math_python", "rollout.environment_kwargs={memory_mb: 256}"])
    assert environment_kwargs_from(cfg)["memory_mb"] == 256  # the recipe's explicit option wins
    calc = load_config(TINY, ["rollout.environment_kwargs={max_turns: 3}"])
    assert environment_kwargs_from(calc) == {"max_turns": 3}
    assert callable(env_factory_from(load_config(TINY)))


def test_routing_replay_defaults(tmp_path, tiny_hf_dir):
    """actor.routing_replay: null is on for an MoE model rolled out by engines (which then return
    routing), on for a recorded file whose records carry routing, off otherwise."""
    from megatron_sao.rollout.settings import routing_replay_enabled
    from megatron_sao.rollout.trajectory_io import write_jsonl, write_parquet
    from tests.training.trajectories import random_trajectories, with_random_routing

    def cfg(*overrides):
        return load_config(TINY, [f"model.hf_path={tiny_hf_dir}", *overrides])

    engine = cfg("rollout.source=engine")
    assert routing_replay_enabled(engine)
    assert engine_config_from(engine).return_routed_experts
    assert agent_loop_config_from(engine).routing.moe_layers == (0, 1)
    assert not engine_config_from(engine, routing=False).return_routed_experts  # evaluation, value pretraining
    assert agent_loop_config_from(engine, routing=False).routing is None
    assert not routing_replay_enabled(cfg("rollout.source=engine", "actor.routing_replay=false"))
    plain = random_trajectories(2, seed=0)
    for suffix, write in ((".parquet", write_parquet), (".jsonl", write_jsonl)):
        without, with_routing = tmp_path / f"plain{suffix}", tmp_path / f"routed{suffix}"
        write(without, plain)
        write(with_routing, with_random_routing(plain))
        assert not routing_replay_enabled(cfg("rollout.source=recorded", f"data.trajectories_path={without}"))
        assert routing_replay_enabled(cfg("rollout.source=recorded", f"data.trajectories_path={with_routing}"))
    assert not engine_config_from(cfg("rollout.source=recorded")).return_routed_experts
