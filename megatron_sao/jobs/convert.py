"""`sao convert {hf-to-mcore, mcore-to-hf, verify}`: the driver of the converters in `checkpointing/`.

`jobs/convert_parser.py`'s `add_convert_parser(subparsers)` registers the `convert` command on the
`sao` parser; every leaf sub-command stores `func` (`run_hf_to_mcore`, `run_mcore_to_hf`,
`run_verify` here), a callable taking the parsed namespace and returning the exit status (0 ok,
1 verification above tolerance), and `quiet_log=True`: the caller (`sao`'s `main`, or
`jobs/convert_parser.py:main` for tools/convert_*.py) runs it through `console.run_command`, which maps exceptions
to exit codes 2 (user error) and 3 (internal error) and sends third-party output to the log file
(`--log-file`, default a fresh file in the temp directory; `-v` keeps it on the terminal). The
command's own lines go to the terminal; its result is the last one.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_sao.checkpointing.manifest import check_checkpoint_kinds
from megatron_sao.utils.console import console_out


def _layout(args: argparse.Namespace):
    from megatron_sao.checkpointing.model_setup import Layout

    return Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp, cp=args.cp)


def _report(rank: int, lines: list[str]) -> None:
    if rank == 0:
        for line in lines:
            print(line, file=console_out(), flush=True)


def _leftovers(args: argparse.Namespace) -> list[str]:
    """Report (or remove, with --remove-leftovers) staging directories of killed conversions."""
    from megatron_sao.checkpointing.output_dir import report_leftovers
    from megatron_sao.platform.run_collective import under_launcher

    if under_launcher() and int(os.environ.get("RANK", "0")) != 0:
        return []
    return report_leftovers(Path(args.out), remove=args.remove_leftovers)


def run_hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.platform.run_collective import run_collective

    check_checkpoint_kinds(args.hf, None)
    notes = _leftovers(args)

    request = HfToMcoreRequest(hf_dir=Path(args.hf), out_dir=Path(args.out), layout=_layout(args), role=args.role,
                               overwrite=args.overwrite, seed=args.seed, value_head_init_std=args.value_head_init_std,
                               progress=not args.no_progress, io_bucket_bytes=int(args.io_bucket_mb * 2**20),
                               io_threads=args.io_threads, fastio=args.fastio)
    rank, result = run_collective(convert_hf_to_mcore, args.nproc, request)
    lines = [*notes]
    head = result["value_head"] or {}
    if head.get("initialized"):
        lines.append(f"value head initialised: normal(0, {head['init_std']}^2), seed {head['seed']} "
                     "(the source has no value head; its lm_head.weight is not used)")
    if result["passthrough"]:
        lines.append(f"carried through unchanged (not in the Megatron model): {len(result['passthrough'])} tensors, "
                     f"e.g. {result['passthrough'][0]}")
    _report(rank, [*lines, f"hf-to-mcore: {result['summary']}"])
    return 0


def run_mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf
    from megatron_sao.platform.run_collective import run_collective

    check_checkpoint_kinds(None, args.mcore)
    notes = _leftovers(args)

    request = McoreToHfRequest(
        mcore_dir=Path(args.mcore), out_dir=Path(args.out),
        hf_config_dir=Path(args.hf_config) if args.hf_config else None, layout=_layout(args), role=args.role,
        dtype=args.dtype, overwrite=args.overwrite, max_shard_bytes=args.max_shard_size,
        verify_checksums=args.verify_checksums, progress=not args.no_progress,
        io_bucket_bytes=int(args.io_bucket_mb * 2**20), fastio=args.fastio)
    rank, result = run_collective(convert_mcore_to_hf, args.nproc, request)
    _report(rank, [*notes, f"mcore-to-hf: {result['summary']}"])
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from megatron_sao.checkpointing.hf_to_mcore import check_hf_source
    from megatron_sao.checkpointing.verify import DEFAULT_PROMPT, VerifyRequest, verify
    from megatron_sao.platform.run_collective import run_collective

    check_checkpoint_kinds(args.hf, args.mcore)
    check_hf_source(Path(args.hf))  # config.json against the weights, as hf-to-mcore checks it

    request = VerifyRequest(hf_dir=Path(args.hf), mcore_dir=Path(args.mcore), layout=_layout(args),
                            prompt=args.prompt or DEFAULT_PROMPT, verify_checksums=args.verify_checksums)
    rank, result = run_collective(verify, args.nproc, request)
    ok = result.max_abs <= args.tolerance
    _report(rank, [f"verify: {result.describe()}",
                   f"verify: {'OK' if ok else 'FAILED'} (tolerance {args.tolerance:g} on the max-abs difference)"])
    return 0 if ok else 1
