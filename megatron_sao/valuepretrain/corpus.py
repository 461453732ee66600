"""The value-pretraining corpus on disk: sharded Parquet of the trajectory record plus a manifest.

    <corpus_dir>/manifest.json            what is complete: shards, SHA-256, counts, tokens, rewards
    <corpus_dir>/train-00000.parquet      trajectories of the training split (rollout/trajectory_io.py schema)
    <corpus_dir>/heldout-00000.parquet    trajectories of the held-out prompts

A shard is written to a temporary sibling (`utils.atomic`: `.<name>.<token>.tmp`), synced, hashed
and renamed; only then is it added to the manifest, which is itself replaced atomically. So a shard
named in the manifest is complete, and anything else in the directory (a temporary, a shard missing
from the manifest) is the leftover of an interrupted write and is rewritten by a resumed `generate`.
Row groups (`row_group_size` rows) are the unit the trainer's data-parallel ranks read and shuffle.

Which split a prompt belongs to is a pure function of the prompt id and the seed (`is_heldout`),
so every sample of a prompt lands in the same split and no held-out prompt is ever trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.rollout.trajectory_io import SCHEMA_VERSION
from megatron_sao.utils.atomic import atomic_path, atomic_write_json

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "heldout")


def is_heldout(prompt_id: str, seed: int, fraction: float) -> bool:
    """Seeded, order-free split of prompts: the first 8 bytes of SHA-256(seed:prompt_id) as a
    number in [0, 1), compared with `fraction`."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def shard_name(split: str, index: int) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return f"{split}-{index:05d}.parquet"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(kw_only=True)
class RewardStats:
    """Moments of the per-trajectory total reward (the Monte-Carlo return at gamma = 1)."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def add(self, value: float) -> None:
        """Non-finite values are left out (such rows are skipped by the reader anyway)."""
        if not math.isfinite(value):
            return
        self.count += 1
        self.total += value
        self.total_sq += value * value
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def merge(self, other: RewardStats) -> None:
        self.count += other.count
        self.total += other.total
        self.total_sq += other.total_sq
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(max(self.total_sq / self.count - self.mean**2, 0.0)) if self.count else math.nan

    def to_dict(self) -> dict[str, Any]:
        finite = self.count > 0
        return {"count": self.count, "sum": self.total, "sum_sq": self.total_sq,
                "min": self.min if finite else None, "max": self.max if finite else None,
                "mean": self.mean if finite else None, "std": self.std if finite else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RewardStats:
        count = int(data["count"])
        return cls(count=count, total=float(data["sum"]), total_sq=float(data["sum_sq"]),
                   min=float(data["min"]) if count else math.inf, max=float(data["max"]) if count else -math.inf)


@dataclasses.dataclass(kw_only=True)
class ShardInfo:
    """One complete shard as the manifest records it."""

    name: str
    split: str
    sha256: str
    num_bytes: int
    num_rows: int
    row_groups: list[int]
    """Rows of each Parquet row group, in file order."""
    tokens: int
    action_tokens: int
    statuses: dict[str, int]
    reward: RewardStats
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Trajectories the generator did not write, by status (e.g. failed, aborted)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["reward"] = self.reward.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "shard") -> ShardInfo:
        """TypeError naming `where` and the field when a field is missing or of the wrong type."""
        if not isinstance(data, dict):
            raise TypeError(f"{where} is {_kind(data)}, expected an object")
        data = dict(data)
        kinds = {"name": str, "split": str, "sha256": str, "num_bytes": int, "num_rows": int, "row_groups": list,
                 "tokens": int, "action_tokens": int, "statuses": dict, "reward": dict, "dropped": dict}
        for field, kind in kinds.items():
            if field == "dropped" and field not in data:
                continue
            if not isinstance(data.get(field), kind) or isinstance(data.get(field), bool):
                raise TypeError(f"{where}.{field} is {_kind(data.get(field))}, expected a {kind.__name__}")
        if data["split"] not in SPLITS:
            raise TypeError(f"{where}.split is {data['split']!r}, expected one of {', '.join(SPLITS)}")
        if Path(data["name"]).name != data["name"] or data["name"] in ("", ".", ".."):
            raise TypeError(f"{where}.name {data['name']!r} must be a file name inside the corpus directory")
        if not all(isinstance(n, int) and n >= 0 for n in data["row_groups"]):
            raise TypeError(f"{where}.row_groups must list row counts (integers >= 0)")
        data["reward"] = RewardStats.from_dict(data["reward"])
        return cls(**data)


@dataclasses.dataclass(kw_only=True)
class Manifest:
    """The corpus's table of contents; `generation` records how it was made (resume checks it)."""

    generation: dict[str, Any] = dataclasses.field(default_factory=dict)
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)

    def shard(self, name: str) -> ShardInfo | None:
        return next((s for s in self.shards if s.name == name), None)

    def split(self, split: str) -> list[ShardInfo]:
        return sorted((s for s in self.shards if s.split == split), key=lambda s: s.name)

    def totals(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for split in SPLITS:
            shards = self.split(split)
            reward = RewardStats()
            statuses: Counter[str] = Counter()
            for s in shards:
                reward.merge(s.reward)
                statuses.update(s.statuses)
            out[split] = {"shards": len(shards), "trajectories": sum(s.num_rows for s in shards),
                          "tokens": sum(s.tokens for s in shards),
                          "action_tokens": sum(s.action_tokens for s in shards),
                          "bytes": sum(s.num_bytes for s in shards), "statuses": dict(statuses),
                          "reward": reward.to_dict()}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "trajectory_schema_version": SCHEMA_VERSION,
                "generation": self.generation, "totals": self.totals(),
                "shards": [s.to_dict() for s in sorted(self.shards, key=lambda s: s.name)]}


def read_manifest(corpus_dir: str | Path) -> Manifest:
    """ValueError naming the file when it is missing, unparseable or of another format version."""
    path = Path(corpus_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no corpus manifest (write the corpus with `sao value-pretrain generate`)")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, expected an object")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {data.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        if not isinstance(data.get("shards"), list):
            raise TypeError(f"field shards is {_kind(data.get('shards'))}, expected a list")
        if not isinstance(data.get("generation", {}), dict):
            raise TypeError(f"field generation is {_kind(data.get('generation'))}, expected an object")
        return Manifest(generation=dict(data.get("generation", {})),
                        shards=[ShardInfo.from_dict(s, where=f"shards[{i}]") for i, s in enumerate(data["shards"])])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a valid corpus manifest: {e}") from e


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def write_manifest(corpus_dir: str | Path, manifest: Manifest) -> Path:
    """Atomic replace (write, fsync, rename): a reader sees the old or the new manifest, never half."""
    path = Path(corpus_dir) / MANIFEST_FILE
    atomic_write_json(path, manifest.to_dict())
    return path


def write_shard(corpus_dir: str | Path, name: str, trajectories: Sequence[Trajectory], row_group_size: int,
                dropped: dict[str, int] | None = None) -> ShardInfo:
    """Write one shard (through a temporary sibling, renamed once complete) and describe it."""
    import pyarrow.parquet as pq

    from megatron_sao.rollout.trajectory_io import trajectories_to_table

    if row_group_size < 1:
        raise ValueError(f"value_pretrain.row_group_size must be >= 1, got {row_group_size}")
    split = name.split("-", 1)[0]
    table = trajectories_to_table(trajectories)
    with atomic_path(Path(corpus_dir) / name) as tmp:
        pq.write_table(table, str(tmp), row_group_size=row_group_size)
        metadata = pq.ParquetFile(tmp).metadata
        row_groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        reward = RewardStats()
        for traj in trajectories:
            reward.add(traj.total_reward)
        info = ShardInfo(name=name, split=split, sha256=sha256_file(tmp), num_bytes=tmp.stat().st_size,
                         num_rows=len(trajectories), row_groups=row_groups, tokens=sum(len(t) for t in trajectories),
                         action_tokens=sum(t.num_action_tokens for t in trajectories),
                         statuses=dict(Counter(str(t.status) for t in trajectories)), reward=reward,
                         dropped=dict(dropped or {}))
    return info


def write_corpus(corpus_dir: str | Path, trajectories: Sequence[Trajectory], *, seed: int, heldout_fraction: float,
                 trajectories_per_shard: int, row_group_size: int, generation: dict[str, Any] | None = None
                 ) -> Manifest:
    """A corpus from trajectories already in memory (recorded or scripted ones; `generate` streams
    instead): split by prompt, cut into shards of `trajectories_per_shard`, manifest written last."""
    if trajectories_per_shard < 1:
        raise ValueError(f"trajectories_per_shard must be >= 1, got {trajectories_per_shard}")
    corpus_dir = Path(corpus_dir)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(generation={"source": "write_corpus", "seed": seed, "heldout_fraction": heldout_fraction,
                                    "row_group_size": row_group_size, **(generation or {})})
    by_split: dict[str, list[Trajectory]] = {split: [] for split in SPLITS}
    for traj in trajectories:
        by_split["heldout" if is_heldout(traj.prompt_id, seed, heldout_fraction) else "train"].append(traj)
    for split, items in by_split.items():
        for index, start in enumerate(range(0, len(items), trajectories_per_shard)):
            chunk = items[start:start + trajectories_per_shard]
            manifest.shards.append(write_shard(corpus_dir, shard_name(split, index), chunk, row_group_size))
    write_manifest(corpus_dir, manifest)
    return manifest
