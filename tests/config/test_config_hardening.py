"""Config values are checked at load (issue 14): finiteness and range of every numeric field,
naming the key and its true source (command line vs recipe file); names that become paths stay
inside their directory; bad files, a missing `base:`, an unparsable override and a mistyped
`describe` section each get one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.config import ConfigError, load_config
from megatron_sao.config.describe import describe
from megatron_sao.config.ranges import RANGES

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=nan", r"rollout\.temperature: expected a finite number, got nan \(from command line\)"),
    ("rollout.temperature=.inf", r"rollout\.temperature: expected a finite number"),
    ("rollout.temperature=0", r"rollout\.temperature must be > 0, got 0\.0 \(from command line\)"),
    ("actor.optim.lr=-1e-6", r"actor\.optim\.lr must be >= 0, got -1e-06 \(from command line\)"),
    ("critic.optim.adam_beta2=1.0", r"critic\.optim\.adam_beta2 must be in \[0, 1\), got 1\.0"),
    ("actor.optim.adam_eps=0", r"actor\.optim\.adam_eps must be > 0"),
    ("rollout.max_new_tokens_per_turn=0", r"rollout\.max_new_tokens_per_turn must be >= 1"),
    ("rollout.top_k=0", r"rollout\.top_k must be -1 \(no top-k\) or >= 1"),
    ("rollout.max_new_tokens_per_turn=999999999", r"exceeds rollout\.max_total_tokens"),
    ("checkpoint.keep_last=0", r"checkpoint\.keep_last must be >= 1"),
])
def test_numbers_are_checked_for_finiteness_and_range_naming_the_command_line(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


def test_a_bad_number_in_the_recipe_file_is_blamed_on_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\nrollout:\n  temperature: -0.5\n")
    with pytest.raises(ConfigError, match=rf"rollout\.temperature must be > 0, got -0\.5 \(from {recipe}\)"):
        load_config(recipe)


def test_cross_field_errors_mention_the_command_line_overrides():
    with pytest.raises(ConfigError, match=r"tiny_cpu\.yaml with command-line overrides of actor\.num_mini_batches"):
        load_config(TINY, ["actor.num_mini_batches=999"])


def test_single_field_ranges_are_checked_once_in_the_ranges_table():
    """The range checks validate.py held (parallelism sizes, DIS / PPO clip ranges, gamma, lambdas,
    critic steps) are in `ranges.RANGES`, blamed on where the value came from."""
    from megatron_sao.config.ranges import RANGES

    for key in ("parallelism.context", "parallelism.expert_tensor", "algorithm.eps_low", "algorithm.gamma",
                "algorithm.lambda_policy", "critic.warmup_steps", "critic.updates_per_actor_step"):
        assert key in RANGES, key
    with pytest.raises(ConfigError, match=r"algorithm\.gamma must be in \(0, 1\], got 0\.0 \(from command line\)"):
        load_config(TINY, ["algorithm.gamma=0"])
    with pytest.raises(ConfigError, match=r"algorithm\.eps_low must be in \(0, 1\), got 1\.0"):
        load_config(TINY, ["algorithm.eps_low=1.0"])


def test_every_range_key_exists_and_every_default_passes():
    load_config(TINY)  # defaults and the tiny recipe are in range
    config = load_config(TINY)
    for key in RANGES:
        node = config
        for part in key.split("."):
            node = getattr(node, part)  # AttributeError: a stale key in the table


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "", "'  x'", "a\\b", "tab\there"])
def test_run_name_cannot_escape_the_output_directory(name):
    with pytest.raises(ConfigError, match=r"run\.name=.* must be a plain name"):
        load_config(TINY, [f"run.name={name}"])


def test_non_utf8_recipe_is_one_clear_error(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{recipe}: not UTF-8 text \(byte \d+"):
        load_config(recipe)


def test_missing_base_names_the_referring_recipe(tmp_path):
    recipe = tmp_path / "child.yaml"
    recipe.write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=rf"recipe file not found: {tmp_path / 'nowhere.yaml'} \(the `base:` of "
                                          rf"{recipe}\)"):
        load_config(recipe)


def test_malformed_list_override_says_the_yaml_did_not_parse():
    with pytest.raises(ConfigError, match=r"critic\.frozen: expected a list of a string, got \[attention,router "
                                          r"\(from command line\); the value is not valid YAML"):
        load_config(TINY, ["critic.frozen=[attention,router"])


def test_describe_typo_suggests_keys_without_a_traceback():
    with pytest.raises(ConfigError, match=r"no config key or section 'critc'; did you mean 'critic'"):
        describe("critc")
    assert "algorithm.eps_low" in describe("algorithm.eps_low")
