"""Write recorded trajectories of the scripted calculator task (megatron_sao/rollout/scripted_trajectories.py)
for recorded-trajectory training, its tests and the CPU demo.

    python tools/make_scripted_trajectories.py --hf HF_DIR --out FILE.parquet --num 256 --seed 0
    python tools/make_scripted_trajectories.py --recipe recipes/tiny_cpu.yaml --out FILE.jsonl --num 64
    python tools/make_scripted_trajectories.py --hf DIR --build-tiny --out FILE.parquet --num 64 --group-size 8

Log-probs come from the checkpoint's own HF model, so the file belongs to that checkpoint. With
`--recipe` the checkpoint is the recipe's `model.hf_path`, built first when the recipe says
`model.build_tiny` (as `sao train` would build it); with `--hf DIR --build-tiny` a default tiny
Qwen3-MoE is built in DIR if it holds no checkpoint.

Idempotent: beside FILE a `FILE.meta.json` records the arguments, the checkpoint's fingerprint
(config.json and the names, sizes and mtimes of its files) and the generator's source hash; when
FILE exists and all of them match, nothing is regenerated (`make demo` calls this every time).
The last line printed is `wrote N trajectories (T tokens, success rate X) to FILE`, or
`kept N trajectories (...) in FILE (up to date)` when nothing had to be written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any


def checkpoint_fingerprint(hf_dir: Path) -> str:
    """Changes when the checkpoint is rebuilt or replaced (content of config.json, name / size /
    mtime of every file) without reading the weights."""
    digest = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for path in sorted(p for p in hf_dir.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def resolve_checkpoint(args: argparse.Namespace) -> Path:
    if args.recipe is not None:
        from megatron_sao.config import load_config
        from megatron_sao.models.build import prepare_hf_checkpoint

        config = load_config(args.recipe, args.overrides)
        return prepare_hf_checkpoint(config.model, seed=config.run.seed).resolve()
    hf = Path(args.hf)
    if not (hf / "config.json").is_file():
        if not args.build_tiny:
            raise ValueError(f"--hf {hf}: no config.json there; pass --build-tiny to build a tiny checkpoint")
        from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

        build_tiny_hf_checkpoint(hf, family=args.tiny_family, seed=args.tiny_seed)
    return hf.resolve()


def summary(trajectories: list[Any]) -> dict[str, Any]:
    return {
        "num_trajectories": len(trajectories),
        "num_tokens": sum(len(t) for t in trajectories),
        "success_rate": sum(bool(t.metadata["success"]) for t in trajectories) / len(trajectories),
    }


def describe(stats: dict[str, Any]) -> str:
    return (f"{stats['num_trajectories']} trajectories ({stats['num_tokens']} tokens, "
            f"success rate {stats['success_rate']:.3f})")


def write(out: Path, trajectories: list[Any]) -> None:
    """Write next to `out`, then rename: a killed run never leaves a half file under its name."""
    from megatron_sao.rollout.trajectory_io import write_jsonl, write_parquet
    from megatron_sao.utils.atomic import atomic_path

    with atomic_path(out) as tmp:
        (write_parquet if out.suffix == ".parquet" else write_jsonl)(tmp, trajectories)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="HuggingFace checkpoint directory (tokenizer and log-prob model)")
    source.add_argument("--recipe", help="a recipe whose model.hf_path is the checkpoint (built if build_tiny)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, section.key=value (with --recipe)")
    parser.add_argument("--out", required=True, type=Path, help="FILE.parquet or FILE.jsonl")
    parser.add_argument("--num", required=True, type=int, help="number of trajectories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=1, help="trajectories per prompt (GRPO), contiguous")
    parser.add_argument("--build-tiny", action="store_true", help="with --hf: build a tiny checkpoint there if none")
    parser.add_argument("--tiny-family", default="qwen3_moe", help="with --build-tiny (default qwen3_moe)")
    parser.add_argument("--tiny-seed", type=int, default=0, help="with --build-tiny (default 0)")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.out.suffix not in (".parquet", ".jsonl"):
        parser.error(f"--out {args.out}: the file name must end in .parquet or .jsonl")
    if args.overrides and args.recipe is None:
        parser.error(f"overrides {args.overrides} need --recipe")
    if args.num < 1 or args.group_size < 1 or args.num % args.group_size:
        parser.error(f"--num ({args.num}) must be a positive multiple of --group-size ({args.group_size})")

    from megatron_sao.rollout import scripted_trajectories

    try:
        hf_dir = resolve_checkpoint(args)
    except ValueError as e:
        parser.error(str(e))
    key = {
        "checkpoint": str(hf_dir),
        "checkpoint_fingerprint": checkpoint_fingerprint(hf_dir),
        "generator_sha256": hashlib.sha256(Path(scripted_trajectories.__file__).read_bytes()).hexdigest(),
        "num": args.num,
        "seed": args.seed,
        "group_size": args.group_size,
    }
    meta_path = args.out.with_name(args.out.name + ".meta.json")
    if args.out.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            print(f"kept {describe(meta['stats'])} in {args.out} (up to date)")
            return 0

    trajectories = scripted_trajectories.make_scripted_trajectories(
        hf_dir, args.num, args.seed, group_size=args.group_size
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)  # never a stale key beside a new file
    write(args.out, trajectories)
    stats = summary(trajectories)
    meta_path.write_text(json.dumps({"key": key, "stats": stats}, indent=1) + "\n")
    print(f"wrote {describe(stats)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
