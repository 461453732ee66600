"""`sao value-pretrain generate`: the policy's rollouts over a prompt set, written as a sharded corpus.

The prompts of `data.train_path` (the first `value_pretrain.num_prompts`) are split into train and
held-out prompts (`corpus.is_heldout`), and each split is cut into shards of
`value_pretrain.prompts_per_shard` prompts. Every prompt is rolled out
`value_pretrain.samples_per_prompt` times by the same engines and runner as RL (`rollout/serving.py`:
the agent loop, or the gateway's scaffold runner for a scaffold environment; engines serve
`model.hf_path`; `rollout.*` sets the environment, limits and sampling). A scaffold episode whose
history was rewritten yields one row per segment, in order. A shard is written the
moment all of its trajectories are in, rows sorted by (prompt, sample); the manifest then names it.

Resume: the plan is a pure function of the prompt file and the settings recorded in the manifest
(`generation`), so a rerun skips the shards the manifest names (after checking their hashes),
deletes leftover temporaries (`*.tmp`), and generates the rest. Changing a recorded setting and rerunning
into the same corpus directory is refused. Trajectories the agent loop ends FAILED or ABORTED are
not written; they are counted per shard under `dropped`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from megatron_sao.valuepretrain.corpus import (
    Manifest,
    is_heldout,
    read_manifest,
    sha256_file,
    shard_name,
    write_manifest,
    write_shard,
)
from megatron_sao.valuepretrain.settings import corpus_dir_of

logger = logging.getLogger(__name__)

KEPT_STATUSES = (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
_SHARD_KEY, _PROMPT_KEY, _SAMPLE_KEY = "vp_shard", "vp_prompt", "vp_sample"


@dataclasses.dataclass
class ShardPlan:
    name: str
    prompts: list[PromptSample]


@dataclasses.dataclass
class GenerateResult:
    corpus_dir: Path
    shards_written: int
    shards_skipped: int
    stopped: bool
    manifest: Manifest


def plan_shards(samples: list[PromptSample], seed: int, heldout_fraction: float,
                prompts_per_shard: int) -> list[ShardPlan]:
    plans = []
    for split in ("train", "heldout"):
        prompts = [s for s in samples if is_heldout(s.prompt_id, seed, heldout_fraction) == (split == "heldout")]
        for index, start in enumerate(range(0, len(prompts), prompts_per_shard)):
            plans.append(ShardPlan(shard_name(split, index), prompts[start:start + prompts_per_shard]))
    return plans


def generation_record(config: SaoConfig, num_prompts: int) -> dict[str, Any]:
    """The settings a corpus was generated with; a resume must match the plan-defining ones."""
    vp, r = config.value_pretrain, config.rollout
    return {"source": "sao value-pretrain generate", "prompts_path": str(config.data.train_path),
            "num_prompts": num_prompts, "samples_per_prompt": vp.samples_per_prompt,
            "prompts_per_shard": vp.prompts_per_shard, "heldout_fraction": vp.heldout_fraction,
            "seed": config.run.seed, "row_group_size": vp.row_group_size, "model": str(config.model.hf_path),
            "environment": r.environment, "reward": r.reward, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "max_turns": r.max_turns, "max_new_tokens_per_turn": r.max_new_tokens_per_turn,
            "max_total_tokens": r.max_total_tokens}


_PLAN_KEYS = ("prompts_path", "num_prompts", "samples_per_prompt", "prompts_per_shard", "heldout_fraction", "seed",
              "row_group_size")


def open_corpus(corpus_dir: Path, record: dict[str, Any]) -> Manifest:
    """The manifest to continue (checked against `record`), leftovers of an interrupted write removed,
    and complete shards whose file is gone or changed forgotten (they are generated again)."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    if not (corpus_dir / "manifest.json").is_file():
        manifest = Manifest(generation=record)
    else:
        manifest = read_manifest(corpus_dir)
        changed = [k for k in _PLAN_KEYS if manifest.generation.get(k) != record[k]]
        if changed:
            diffs = ", ".join(f"{k}: {manifest.generation.get(k)!r} -> {record[k]!r}" for k in changed)
            raise ValueError(f"value_pretrain.corpus_dir={corpus_dir} holds a corpus generated with other settings "
                             f"({diffs}); use another corpus_dir or restore the settings to resume it")
        kept = []
        for shard in manifest.shards:
            path = corpus_dir / shard.name
            if path.is_file() and sha256_file(path) == shard.sha256:
                kept.append(shard)
            else:
                logger.warning("shard %s is missing or changed since it was written: generating it again", shard.name)
        manifest.shards = kept
    for leftover in corpus_dir.glob("*.tmp"):  # `utils.atomic`'s temporaries (hidden) and older `<shard>.tmp`
        leftover.unlink()
    return manifest


def _env_factory(config: SaoConfig) -> Any:
    from megatron_sao.rollout.settings import env_factory_from

    return env_factory_from(config)  # the same environment (and options) as RL


def _feed(plans: list[ShardPlan], samples_per_prompt: int) -> Iterator[PromptSample]:
    for plan in plans:
        for p, prompt in enumerate(plan.prompts):
            for k in range(samples_per_prompt):
                yield dataclasses.replace(prompt, metadata={**prompt.metadata, _SHARD_KEY: plan.name, _PROMPT_KEY: p,
                                                            _SAMPLE_KEY: k})


class _Progress:
    """One line per update on stderr: shards, trajectories, tokens, rate and ETA (tqdm)."""

    def __init__(self, total: int, shards: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="traj", file=sys.stderr, dynamic_ncols=True, desc="generate",
                        mininterval=1.0)
        self.tokens, self.shards, self.total_shards, self.start = 0, 0, shards, time.perf_counter()

    def update(self, traj: Trajectory, ended: bool = True) -> None:
        """`traj`'s tokens; one more on the bar when it `ended` its episode."""
        self.tokens += len(traj)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"shards {self.shards}/{self.total_shards} tokens {self.tokens} ({rate:.0f}/s)",
                                 refresh=False)
        self.bar.update(int(ended))

    def close(self) -> None:
        self.bar.close()


async def _run(config: SaoConfig, plans: list[ShardPlan], manifest: Manifest, corpus_dir: Path,
               stop: asyncio.Event) -> int:
    from transformers import AutoTokenizer

    from megatron_sao.rollout.serving import Serving, is_last_segment
    from megatron_sao.rollout.settings import agent_loop_config_from, engine_config_from

    vp = config.value_pretrain
    expected = {plan.name: len(plan.prompts) * vp.samples_per_prompt for plan in plans}
    pending: dict[str, list[Trajectory]] = {plan.name: [] for plan in plans}
    dropped: dict[str, dict[str, int]] = {plan.name: {} for plan in plans}
    received = dict.fromkeys(expected, 0)
    written = 0
    progress = _Progress(sum(expected.values()), len(plans))
    # The critic routes itself: value-pretraining rollouts need no routed experts.
    engine_config = dataclasses.replace(engine_config_from(config, routing=False),
                                        log_dir=str(corpus_dir / "engine_logs"))
    # The same composition as RL (`rollout/serving.py`): a scaffold environment runs through the gateway.
    serving = Serving(engine_config, agent_loop_config_from(config, routing=False),
                      AutoTokenizer.from_pretrained(config.model.hf_path), _env_factory(config),
                      config.rollout.max_inflight_per_engine)
    try:
        async with serving:
            runner = serving.runner
            watcher = asyncio.create_task(_abort_on(stop, runner))
            async for traj in runner.iter_trajectories(_feed(plans, vp.samples_per_prompt)):
                name = traj.metadata[_SHARD_KEY]
                ended = is_last_segment(traj)  # a scaffold episode may come in several segments: one episode
                received[name] += ended
                progress.update(traj, ended)
                if traj.status in KEPT_STATUSES:
                    pending[name].append(traj)
                else:
                    dropped[name][str(traj.status)] = dropped[name].get(str(traj.status), 0) + 1
                if received[name] == expected[name] and not stop.is_set():
                    rows = sorted(pending.pop(name), key=lambda t: (t.metadata[_PROMPT_KEY], t.metadata[_SAMPLE_KEY],
                                                                    t.metadata.get("segment", 0)))
                    manifest.shards.append(write_shard(corpus_dir, name, rows, vp.row_group_size, dropped[name]))
                    write_manifest(corpus_dir, manifest)
                    written += 1
                    progress.shards += 1
            watcher.cancel()
    finally:
        progress.close()
    return written


async def _abort_on(stop: asyncio.Event, loop: Any) -> None:
    await stop.wait()
    await loop.abort()


def run_generate(config: SaoConfig) -> GenerateResult:
    """Generate every shard the corpus directory does not hold yet. SIGTERM / SIGINT stop it after
    the shards already complete (a rerun continues)."""
    from megatron_sao.models.build import prepare_hf_checkpoint
    from megatron_sao.rollout.datasets import DatasetConfig, load_prompts
    from megatron_sao.valuepretrain.settings import check_value_pretrain_config

    check_value_pretrain_config(config, for_training=False)
    vp = config.value_pretrain
    if not config.data.train_path:
        raise ValueError("data.train_path is empty: set it to the prompt file (JSONL or Parquet) to roll out")
    prepare_hf_checkpoint(config.model, seed=config.run.seed)
    samples = load_prompts(config.data.train_path, DatasetConfig(max_prompt_chars=config.data.max_prompt_chars)).samples
    samples = samples[:vp.num_prompts] if vp.num_prompts is not None else samples
    corpus_dir = corpus_dir_of(config)
    manifest = open_corpus(corpus_dir, generation_record(config, len(samples)))
    plans = plan_shards(samples, config.run.seed, vp.heldout_fraction, vp.prompts_per_shard)
    done = {s.name for s in manifest.shards}
    todo = [plan for plan in plans if plan.name not in done]
    print(f"corpus {corpus_dir}: {len(plans)} shards planned ({len(samples)} prompts x {vp.samples_per_prompt} "
          f"samples), {len(plans) - len(todo)} complete, {len(todo)} to generate", flush=True)
    written, stopped = 0, False
    if todo:
        written, stopped = asyncio.run(_with_signals(config, todo, manifest, corpus_dir))
    write_manifest(corpus_dir, manifest)
    return GenerateResult(corpus_dir, written, len(plans) - len(todo), stopped, manifest)


async def _with_signals(config: SaoConfig, todo: list[ShardPlan], manifest: Manifest,
                        corpus_dir: Path) -> tuple[int, bool]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        written = await _run(config, todo, manifest, corpus_dir, stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return written, stop.is_set()
