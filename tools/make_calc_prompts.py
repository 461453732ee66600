"""Write a prompt dataset of the calculator task (the `calc` environment) as JSONL.

    .venv/bin/python tools/make_calc_prompts.py --out checkpoints/calc/train.jsonl --num 2048 --seed 0

Same arguments, same problems (`megatron_sao.rollout.envs.calc.generate_calc_samples`); an
existing file written with the same arguments is kept. Prints one line naming the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-digits", type=int, default=2)
    args = parser.parse_args()
    from megatron_sao.rollout.envs.calc import write_calc_dataset

    stamp = args.out.with_suffix(args.out.suffix + ".args.json")
    wanted = {"num": args.num, "seed": args.seed, "max_digits": args.max_digits}
    if args.out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        print(f"kept {args.num} calc prompts in {args.out} (up to date)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_calc_dataset(args.out, args.num, args.seed, max_digits=args.max_digits)
    stamp.write_text(json.dumps(wanted) + "\n")
    print(f"wrote {args.num} calc prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
