"""Recipes + overrides load into typed config; bad input fails fast, naming key and source."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.config import ConfigError, dump_config, load_config
from megatron_sao.config.describe import describe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


def test_every_shipped_recipe_loads():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert TINY in recipes
    for recipe in recipes:
        load_config(recipe)


def test_overrides_are_typed():
    cfg = load_config(TINY, ["actor.optim.lr=2e-6", "actor.optim.min_lr=0", "critic.frozen=[attention,router]",
                             "run.name=123", "algorithm.lambda_policy=null", "parallelism.sequence_parallel=true"])
    assert cfg.actor.optim.lr == 2e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.critic.frozen == ["attention", "router"]
    assert cfg.run.name == "123"
    assert cfg.algorithm.lambda_policy is None
    assert cfg.parallelism.sequence_parallel is True


def test_recipe_relative_paths_resolve_against_the_recipe(tmp_path):
    cfg = load_config(TINY)
    assert Path(cfg.model.hf_path) == REPO / "checkpoints" / "tiny-qwen3-moe" / "hf"
    cli = load_config(TINY, ["model.hf_path=rel/dir"])
    assert cli.model.hf_path == "rel/dir"


def test_wrong_type_names_key_and_source():
    with pytest.raises(ConfigError, match=r"model\.num_experts: expected an integer or null, got abc "
                                          r"\(from command line\)"):
        load_config(TINY, ["model.num_experts=abc"])


def test_wrong_type_in_file_names_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("critic:\n  updates_per_actor_step: two\n")
    with pytest.raises(ConfigError, match=rf"critic\.updates_per_actor_step: expected an integer.*{recipe.name}"):
        load_config(recipe)


def test_typo_suggests_closest_key(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("algorithm:\n  eps_hgih: 3.0\n")
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm\.eps_hgih'.*typo\.yaml.*did you mean "
                                          r"'algorithm\.eps_high'"):
        load_config(recipe)
    with pytest.raises(ConfigError, match=r"did you mean 'model\.num_experts'"):
        load_config(TINY, ["model.num_expert=4"])


def test_bad_parallel_product_is_rejected():
    with pytest.raises(ConfigError, match=r"parallelism\.tensor x parallelism\.pipeline x parallelism\.context "
                                          r"= 2 x 2 x 1 = 4 does not divide the trainer world size 2"):
        load_config(TINY, ["parallelism.tensor=2", "parallelism.pipeline=2"])
    with pytest.raises(ConfigError, match=r"parallelism\.expert_tensor x parallelism\.expert"):
        load_config(TINY, ["parallelism.expert=4"])
    with pytest.raises(ConfigError, match=r"sequence parallel"):
        load_config(TINY, ["parallelism.tensor=2", "parallelism.expert=1", "parallelism.sequence_parallel=false"])


@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.eps_low=1.0", "algorithm.eps_low"),
    ("algorithm.eps_low=0", "algorithm.eps_low"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("critic.updates_per_actor_step=0", "critic.updates_per_actor_step"),
    ("critic.frozen=[attn]", r"critic\.frozen\[0\]"),
    ("actor.trainable=[re:(]", r"actor\.trainable\[0\]"),
    ("algorithm.advantage=grpo", "algorithm.advantage=grpo"),
    ("rollout.engine=vllm", "rollout.engine"),
])
def test_impossible_values_are_rejected(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TINY, [override])


def test_malformed_override_and_non_section():
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(TINY, ["actor.optim.lr"])
    with pytest.raises(ConfigError, match=r"'run\.name' is not a section"):
        load_config(TINY, ["run.name.x=1"])


def test_base_recipe_chain(tmp_path):
    (tmp_path / "base.yaml").write_text("run:\n  name: base\n  seed: 7\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nrun:\n  name: child\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.run.name, cfg.run.seed) == ("child", 7)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "loop.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["actor.optim.lr=3e-6", "actor.optim.min_lr=1e-7"])
    path = dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(path) == cfg


def test_paper_defaults():
    cfg = load_config(None)
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr) == (1e-6, 5e-6)
    assert cfg.critic.updates_per_actor_step == 2 and cfg.critic.warmup_steps == 10
    assert cfg.critic.frozen == ["attention"] and cfg.actor.frozen == []
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high, cfg.algorithm.lambda_alpha) == (0.3, 5.0, 1.5)
    assert cfg.algorithm.group_size == 1 and cfg.data.batch_size == 128


def test_describe_documents_every_leaf_key():
    text = describe()
    assert "algorithm.eps_low" in text and "DIS band lower edge" in text
    for line in text.splitlines():
        if not line.startswith(" "):
            assert "default" in line
    with pytest.raises(ValueError):
        describe("no_such_section")


def test_param_group_vocabulary_matches_models():
    from megatron_sao.config.validate import PARAM_GROUPS
    from megatron_sao.models.param_groups import GROUPS

    assert ("all", *GROUPS) == PARAM_GROUPS


def test_layout_must_fit_the_model(tmp_path):
    from megatron_sao.models.build import check_layout_fits_model

    hf = tmp_path / "hf"
    ok = load_config(TINY, [f"model.hf_path={hf}"])
    check_layout_fits_model(ok)  # builds the tiny checkpoint: 4 heads, 2 query groups, 4 experts, 2 layers
    with pytest.raises(ConfigError, match=r"parallelism\.tensor = 4 does not divide the model's num_query_groups = 2"):
        check_layout_fits_model(load_config(TINY, [f"model.hf_path={hf}", "parallelism.tensor=4",
                                                   "parallelism.expert=1", "parallelism.world_size=4"]))
    with pytest.raises(ConfigError, match=r"num_experts = 4"):
        check_layout_fits_model(load_config(TINY, [f"model.hf_path={hf}", "parallelism.expert=8",
                                                   "parallelism.world_size=8"]))
    with pytest.raises(ConfigError, match=r"num_layers = 2"):
        check_layout_fits_model(load_config(TINY, [f"model.hf_path={hf}", "parallelism.pipeline=4",
                                                   "parallelism.expert=1", "parallelism.world_size=4"]))
