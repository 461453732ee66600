"""The stages `sao demo`, `sao online` and `sao study` share: each stage's own run directory
under `<run.output_dir>/<run.name>/`, the HF -> Megatron conversion, SFT on scripted
demonstrations, the actor exported as an HF checkpoint (both by the converters `sao convert`
runs, in a spawned process), value pretraining, and the SAO stage's
settings on top of the recipe (`prepare_policy_and_critic` runs stages 1-3; each skips what is
complete). Public so that the jobs import it, not each other's private helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.jobs.demo_plan import DemoPlan, demonstrations_file, prompt_files


def stage_config(config: SaoConfig, stage: str, *, under: Path | None = None, **overrides: Any) -> SaoConfig:
    """`config` for one stage: its own run directory `<output_dir>/<name>/<stage>` (or `under/<stage>`),
    beside the recipe it is loaded from (`<stage>.recipe.yaml`)."""
    import yaml

    from megatron_sao.config.loader import config_to_dict, load_config

    base = Path(under) if under is not None else Path(config.run.output_dir) / config.run.name
    base.mkdir(parents=True, exist_ok=True)
    recipe = base / f"{stage}.recipe.yaml"
    recipe.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    pairs = [f"run.output_dir={base}", f"run.name={stage}", *(f"{k}={v}" for k, v in overrides.items())]
    return load_config(recipe, pairs)


def convert_to_mcore(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` converted into a Megatron checkpoint at `out` (kept when already there), by the
    converter itself (`checkpointing.hf_to_mcore.convert_hf_to_mcore`) on one spawned process:
    its torch.distributed world stays out of the driver's. Its result line is said as
    `sao convert hf-to-mcore` prints it; a bad input is its own user error."""
    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.checkpointing.manifest import check_checkpoint_kinds
    from megatron_sao.platform import run_distributed

    if (out / "sao_manifest.json").is_file():
        return out
    check_checkpoint_kinds(str(hf_dir), None)
    request = HfToMcoreRequest(hf_dir=Path(hf_dir), out_dir=Path(out), progress=False)
    result = run_distributed(convert_hf_to_mcore, 1, request, timeout_s=float("inf"))[0]
    say(f"hf-to-mcore: {result['summary']}")
    return out


def latest_checkpoint(run_dir: Path) -> Path:
    from megatron_sao.training.checkpoint import find_latest_checkpoint

    found = find_latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        raise RuntimeError(f"{run_dir} has no complete checkpoint")
    return found


def export_actor(config: SaoConfig, out: Path) -> Path:
    """The actor of `config` (`actor.load`) as an HF checkpoint engines can serve (kept when already
    there), written by the converter `sao convert mcore-to-hf` runs
    (`training.checkpoint.export.export_role_hf`) with the config and tokenizer of `model.hf_path`."""
    from megatron_sao.training.checkpoint.export import export_role_hf

    if not (out / "config.json").is_file():
        export_role_hf(Path(config.actor.load), "actor", Path(config.model.hf_path), out)
    return out


@dataclass(frozen=True, slots=True)
class Prepared:
    """What stages 1-3 leave for RL: the SFT policy (HF), the value-pretrained critic, the prompts."""

    base: Path
    sft_hf: Path
    critic_checkpoints: Path
    train_prompts: Path
    heldout: list[Any]


def prepare_policy_and_critic(config: SaoConfig, plan: DemoPlan) -> Prepared:
    """Stages 1-3 of the demo (model, conversion, SFT, value pretraining), each skipped when its
    output exists: `sao demo` and `sao online` start RL from here."""
    from megatron_sao.jobs.train import run_train
    from megatron_sao.jobs.value_pretrain import run_pretrain
    from megatron_sao.models.build import prepare_hf_checkpoint
    from megatron_sao.models.hf_files import inspect_hf_checkpoint
    from megatron_sao.utils.progress import stage_progress
    from megatron_sao.valuepretrain.generate import run_generate

    seed = config.run.seed
    base = Path(config.run.output_dir) / config.run.name
    base.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare_hf_checkpoint(config.model, seed=seed)
    inspect_hf_checkpoint(hf_dir)  # the weights stage 1 converts are there (not a config-only directory)
    say(f"[1/5] model {hf_dir}")
    mcore = convert_to_mcore(hf_dir, base / "mcore")
    train_prompts, heldout = prompt_files(base, plan, seed)

    say("[2/5] SFT on demonstrations")
    sft = stage_config(config, "sft", **sft_stage_overrides(plan, demonstrations_file(config, base, plan, seed), mcore))
    check_stage(run_train(sft, mode="sft"))
    trained = replace(sft, actor=replace(sft.actor, load=str(latest_checkpoint(base / "sft"))))
    sft_hf = export_actor(trained, base / "sft_hf")

    say("[3/5] value pretraining on the SFT policy's rollouts")
    value = stage_config(config, "value", **{
        "model.hf_path": sft_hf, "data.train_path": train_prompts, "run.total_steps": plan.value_steps,
        "value_pretrain.corpus_dir": base / "value_corpus", "value_pretrain.num_prompts": plan.value_prompts,
        "value_pretrain.samples_per_prompt": plan.value_samples_per_prompt, "critic.updates_per_actor_step": 1,
        "checkpoint.save_every": 0, "value_pretrain.eval_every": plan.value_steps, "launcher.ray": False})
    run_generate(value)
    with stage_progress(value, Path(value.run.output_dir) / value.run.name):
        check_stage(run_pretrain(value))
    return Prepared(base, sft_hf, base / "value" / "checkpoints", train_prompts, heldout)


def sft_stage_overrides(plan: DemoPlan, demonstrations: Path, mcore: Path) -> dict[str, Any]:
    """The SFT stage's settings on top of the recipe: the plan's sizes at a constant learning rate
    (the recipe's actor schedule, cosine in tiny_cpu.yaml, is the RL stage's)."""
    return {"data.trajectories_path": demonstrations, "actor.load": mcore, "run.total_steps": plan.sft_steps,
            "actor.optim.lr": plan.sft_lr, "actor.optim.lr_decay_style": "constant", "actor.optim.min_lr": 0.0,
            "data.batch_size": plan.sft_batch_size, "checkpoint.save_every": 0, "rollout.source": "recorded",
            "launcher.ray": False}


def rl_stage_overrides(prepared: Prepared, plan: DemoPlan) -> dict[str, Any]:
    """The SAO stage's settings on top of the recipe: actor from the SFT policy, critic from value
    pretraining (so no critic-only warmup), prompts streamed to the engines (`sao study` runs its
    variants from the same)."""
    return {"model.hf_path": prepared.sft_hf, "critic.load": prepared.critic_checkpoints, "rollout.source": "engine",
            "data.train_path": prepared.train_prompts, "critic.warmup_steps": 0, "launcher.ray": plan.ray}


def say(line: str) -> None:
    """A line of the demo's own on the terminal (third-party output goes to the log file)."""
    from megatron_sao.utils.console import console_out

    print(line, file=console_out(), flush=True)


def check_stage(result: tuple[int, dict[str, Any], Path]) -> None:
    code, _, run_dir = result
    if code != 0:
        raise RuntimeError(f"stage {run_dir} stopped with exit code {code}")
