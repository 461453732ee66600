"""Where the corpus lives and which `value_pretrain` settings are usable, checked before anything starts."""

from __future__ import annotations

from pathlib import Path

from megatron_sao.config.schema import SaoConfig


def corpus_dir_of(config: SaoConfig) -> Path:
    """`value_pretrain.corpus_dir`, or `<run.output_dir>/<run.name>/corpus` when empty."""
    vp = config.value_pretrain
    return Path(vp.corpus_dir) if vp.corpus_dir else Path(config.run.output_dir) / config.run.name / "corpus"


def check_value_pretrain_config(config: SaoConfig, for_training: bool) -> None:
    """ValueError naming the key for settings the value-pretraining jobs cannot run with."""
    from megatron_sao.config.validate import data_parallel_size
    from megatron_sao.training.advantages import needs_critic

    vp = config.value_pretrain
    checks = [
        (vp.samples_per_prompt >= 1, f"value_pretrain.samples_per_prompt must be >= 1, got {vp.samples_per_prompt}"),
        (vp.num_prompts is None or vp.num_prompts >= 1, f"value_pretrain.num_prompts must be >= 1 or null, got "
                                                        f"{vp.num_prompts}"),
        (vp.prompts_per_shard >= 1, f"value_pretrain.prompts_per_shard must be >= 1, got {vp.prompts_per_shard}"),
        (vp.row_group_size >= 1, f"value_pretrain.row_group_size must be >= 1, got {vp.row_group_size}"),
        (0.0 <= vp.heldout_fraction < 1.0, f"value_pretrain.heldout_fraction must be in [0, 1), got "
                                           f"{vp.heldout_fraction}"),
        (vp.eval_every >= 0, f"value_pretrain.eval_every must be >= 0, got {vp.eval_every}"),
        (vp.eval_max_trajectories >= 1, f"value_pretrain.eval_max_trajectories must be >= 1, got "
                                        f"{vp.eval_max_trajectories}"),
        (vp.calibration_bins >= 1, f"value_pretrain.calibration_bins must be >= 1, got {vp.calibration_bins}"),
    ]
    if for_training:
        dp = data_parallel_size(config)
        checks += [
            (needs_critic(config.algorithm), f"algorithm.advantage={config.algorithm.advantage} has no critic; value "
                                             "pretraining needs a critic-based estimator (gae or step_level)"),
            (config.data.batch_size % dp == 0, f"data.batch_size={config.data.batch_size} must be a multiple of the "
                                               f"data-parallel size {dp} (each rank streams its own share)"),
        ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if for_training and not (corpus_dir_of(config) / "manifest.json").is_file():
        raise ValueError(f"value_pretrain.corpus_dir: {corpus_dir_of(config)} holds no corpus (manifest.json); "
                         "write one with `sao value-pretrain generate` first")
