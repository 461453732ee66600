"""The memory model and `sao plan`: shipped recipes fit their GPUs, squeezed ones do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.config import ConfigError
from megatron_sao.jobs.plan import build_plan

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# The GPU each shipped recipe states in its header comment.
STATED_GPU = {
    "qwen3_30b_a3b_math_sao.yaml": "h100-80g",
    "qwen3_30b_a3b_math_sao_1node_colocated.yaml": "h200-141g",
    "qwen3_30b_a3b_math_grpo.yaml": "h100-80g",
    "qwen3_30b_a3b_math_grpo_dis.yaml": "h100-80g",
    "qwen3_30b_a3b_swe_sao.yaml": "h100-80g",
    "qwen3_30b_a3b_swe_grpo.yaml": "h100-80g",
    "qwen3_30b_a3b_swe_grpo_dis.yaml": "h100-80g",
    "qwen3_235b_a22b_math_sao.yaml": "h200-141g",
    "glm45_355b_a32b_math_sao.yaml": "h200-141g",
    "deepseek_v3_671b_math_sao.yaml": "h200-141g",
    "glm5_744b_a40b_swe_sao.yaml": "h200-141g",
}


def test_every_shipped_scale_recipe_is_listed_and_states_its_gpu_type() -> None:
    shipped = {p.name for p in RECIPES.glob("*.yaml") if not p.name.startswith("tiny_")}  # tiny_*: CPU recipes
    assert shipped == set(STATED_GPU)
    from megatron_sao.config import load_config

    for name, gpu in STATED_GPU.items():
        assert load_config(str(RECIPES / name), []).launcher.gpu_type == gpu, name


def test_plan_defaults_to_the_recipes_gpu_type() -> None:
    plan, _ = build_plan(str(RECIPES / "deepseek_v3_671b_math_sao.yaml"), [])
    assert plan["gpu"] == "h200-141g"
    plan, _ = build_plan(str(RECIPES / "deepseek_v3_671b_math_sao.yaml"), ["launcher.gpu_type=b200-180g"])
    assert plan["gpu"] == "b200-180g"


@pytest.mark.parametrize("name", sorted(STATED_GPU))
def test_shipped_recipe_fits_its_gpu(name: str) -> None:
    plan, text = build_plan(str(RECIPES / name), [], STATED_GPU[name])
    assert plan["fits"], text
    assert plan["memory_gib_per_gpu"]["total"] <= plan["gpu_memory_gib"]
    assert "verdict: fits" in text


def test_squeezed_onto_one_node_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"launcher\.nnodes x launcher\.nproc_per_node = 1 x 8 = 8"):
        build_plan(str(RECIPES / "qwen3_30b_a3b_math_sao.yaml"), ["launcher.nnodes=1"], "h100-80g")


def test_squeezed_trainers_do_not_fit_and_name_the_term() -> None:
    # 8 trainer GPUs instead of 32 (16 still fit now that logits are computed in chunks).
    plan, text = build_plan(str(RECIPES / "qwen3_30b_a3b_math_sao.yaml"),
                            ["launcher.nnodes=2", "parallelism.world_size=8", "parallelism.expert=8",
                             "rollout.num_engines=2"], "h100-80g")
    assert not plan["fits"]
    assert plan["largest_term"] == "actor_optimizer"
    assert "does not fit on h100-80g (largest term: actor_optimizer)" in text


def test_engine_weights_that_crowd_out_the_kv_cache_are_named() -> None:
    plan, _ = build_plan(str(RECIPES / "qwen3_235b_a22b_math_sao.yaml"),
                         ["rollout.sglang.tensor=2", "rollout.sglang.expert=2"], "h200-141g")
    assert not plan["fits"] and plan["largest_term"] == "engine_weights"


def _terms(overrides: list[str]) -> dict[str, float]:
    plan, _ = build_plan(str(RECIPES / "qwen3_30b_a3b_math_sao.yaml"), overrides, "h100-80g")
    return plan["memory_gib_per_gpu"]


def test_more_expert_parallelism_shards_expert_weights_and_grads() -> None:
    ep16, ep32 = _terms(["parallelism.expert=16"]), _terms([])
    assert ep32["actor_weights"] < ep16["actor_weights"]
    assert ep32["actor_grads"] < ep16["actor_grads"]
    # The distributed optimizer shards experts over expert-DP = world / EP: the same per GPU.
    assert ep32["actor_optimizer"] == pytest.approx(ep16["actor_optimizer"], rel=1e-6)


def test_full_recompute_keeps_fewer_activations() -> None:
    assert _terms([])["activations"] < _terms(["model.recompute_granularity=none"])["activations"]


def test_frozen_critic_attention_has_no_gradients_or_optimizer_state() -> None:
    frozen = _terms([])
    trained = _terms(["critic.frozen=[]"])
    assert frozen["critic_weights"] == trained["critic_weights"]
    assert frozen["critic_grads"] < trained["critic_grads"]
    assert frozen["critic_optimizer"] < trained["critic_optimizer"]


def test_grpo_has_no_critic() -> None:
    plan, _ = build_plan(str(RECIPES / "qwen3_30b_a3b_math_grpo.yaml"), [], "h100-80g")
    terms = plan["memory_gib_per_gpu"]
    assert terms["critic_weights"] == terms["critic_grads"] == terms["critic_optimizer"] == 0


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(RECIPES / "deepseek_v3_671b_math_sao.yaml"), "--gpu", "h200-141g", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params_total", "params_active", "params_mtp", "memory_gib_per_gpu", "fits", "largest_term"):
        assert key in out
    assert out["memory_gib_per_gpu"]["total"] == pytest.approx(
        sum(v for k, v in out["memory_gib_per_gpu"].items() if k != "total"), abs=0.01)
    assert out["params_mtp"] > 11e9


def test_cli_exit_codes(capfd: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "qwen3_30b_a3b_math_sao.yaml")
    assert main(["plan", recipe, "parallelism.world_size=8", "parallelism.expert=8", "launcher.nnodes=2",
                 "rollout.num_engines=2"]) == 1
    assert main(["plan", recipe, "launcher.nnodes=1"]) == 2
    assert "sao plan: config error: parallelism.world_size = 32" in capfd.readouterr().err


def test_tiny_recipe_plans_without_a_checkpoint(tmp_path: Path) -> None:
    plan, _ = build_plan(str(RECIPES / "tiny_cpu.yaml"), [f"model.hf_path={tmp_path / 'none'}"])
    assert plan["params_total"] > 0 and plan["gpus"]["engine"] == 0
    assert not (tmp_path / "none").exists()


def test_activations_are_linear_in_trajectory_length_and_split_by_cp() -> None:
    """One trajectory per micro-batch: no [s, s] term (flash attention, no mask), logits in chunks."""
    def activations(tokens: int, overrides: list[str] = ()) -> float:
        return _terms([f"rollout.max_total_tokens={tokens}", "model.recompute_granularity=none", *overrides])[
            "activations"]

    a32, a64, a128 = activations(32768), activations(65536), activations(131072)
    assert a128 - a64 == pytest.approx(2 * (a64 - a32), abs=2e-3)  # linear (the plan rounds to MiB)
    # CP 4 -> CP 2 doubles every token a rank holds (logits too, when not chunked).
    whole = ["actor.logits_chunk_tokens=null"]
    cp2 = ["parallelism.context=2", "parallelism.world_size=16", "parallelism.expert=16", "launcher.nnodes=3",
           "rollout.num_engines=4"]
    assert activations(131072, [*whole, *cp2]) == pytest.approx(2 * activations(131072, whole), abs=2e-3)


def test_a_trajectory_over_the_token_budget_is_planned_alone() -> None:
    """training/batches.py gives a trajectory longer than max_tokens_per_micro_batch its own
    micro-batch: the planner counts that micro-batch, not the budget."""
    small_budget = _terms(["actor.max_tokens_per_micro_batch=1024", "critic.max_tokens_per_micro_batch=1024"])
    assert small_budget["activations"] == pytest.approx(_terms([])["activations"], rel=1e-6)


def test_logits_chunk_tokens_bounds_the_logit_term() -> None:
    chunked, whole = _terms([]), _terms(["actor.logits_chunk_tokens=null"])
    assert whole["activations"] > chunked["activations"] + 10  # 32K tokens x 76K vocab: > 10 GiB more
