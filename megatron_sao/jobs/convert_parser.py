"""The `sao convert {hf-to-mcore, mcore-to-hf, verify}` command line: sub-commands, flags, help.

`add_convert_parser(subparsers)` registers `convert` on a `sao` sub-parser set (`cli.py`; `main`
below for tools/convert_*.py; `sao launch slurm --command 'convert ...'` checks a command with it
before submitting); each leaf stores its runner in `jobs/convert.py` as `func`.
"""

from __future__ import annotations

import argparse

from megatron_sao.checkpointing.families import FAMILIES
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.jobs.convert import run_hf_to_mcore, run_mcore_to_hf, run_verify
from megatron_sao.utils.args import SaoArgumentParser, byte_size, float_in, int_at_least

_LAYOUT_HELP = """
parallel layout (the model is built in it; the torch_dist checkpoint itself reshards on load into
any other): world size = tp x pp x dp, with (etp x ep) dividing tp x dp. Run on several processes
with --nproc N (local), or under torchrun / srun (docs/conversion.md#multi-process), e.g.
  torchrun --nproc-per-node 8 tools/convert_hf_to_mcore.py --hf H --out M --tp 2 --ep 4
"""

_FAMILIES_HELP = "supported architectures:\n" + "\n".join(
    f"  {f.architecture:<24} {f.models}" + (f"\n  {'':<24} note: {f.note}" if f.note else "")
    for f in FAMILIES.values()
)


def _add_layout(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout", _LAYOUT_HELP)
    group.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel size (default 1)")
    group.add_argument("--pp", type=int_at_least(1), default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=int_at_least(1), default=1, help="expert-parallel size (default 1)")
    group.add_argument("--etp", type=int_at_least(1), default=None, help="expert tensor-parallel size (default: --tp)")
    group.add_argument("--vpp", type=int_at_least(1), default=None,
                       help="virtual pipeline stages per pipeline rank (needs --pp > 1; default none)")
    group.add_argument("--cp", type=int_at_least(1), default=1, help="context-parallel size (default 1)")
    group.add_argument("--nproc", type=int_at_least(1), default=1,
                       help="spawn this many local processes (ignored under torchrun/srun; default 1)")


def _add_log_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-file", metavar="PATH", default=None,
                        help="where third-party output (warnings, library logs) goes; default: a new "
                             "sao-convert-*.log in the temp directory; `sao -v` shows it on the terminal instead")
    parser.set_defaults(quiet_log=True)


def _add_checksum_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                        help="check every file's digest (xxh3-128; SHA-256 in v1 manifests) against the manifest "
                             "before loading (default: on; "
                             "--no-verify-checksums skips this extra read of the checkpoint)")


def _add_fastio_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fastio", action="store_true",
                        help="the fast-I/O path (default off): O_DIRECT reads and writes, memory given back as it "
                             "is written, raw torch_dist reads; tuned on the 2-core CI VM, not yet measured on a GPU "
                             "node (docs/conversion.md#fast-io)")


def _add_io_bucket_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--io-bucket-mb", type=float_in(0.0, low_open=True), metavar="MB",
                        default=DEFAULT_IO_BUCKET_BYTES / 2**20,
                        help=f"{what} (default {DEFAULT_IO_BUCKET_BYTES // 2**20})")


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is a previous conversion output (atomically, at the end); "
                             "an --out that is, contains or sits inside the source is always refused")
    parser.add_argument("--remove-leftovers", action="store_true",
                        help="delete staging directories that killed conversions into --out left behind "
                             "(reported either way)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    _add_log_flag(parser)


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `convert` (with hf-to-mcore, mcore-to-hf, verify) on a `sao` sub-parser set."""
    formatter = argparse.RawDescriptionHelpFormatter
    convert = subparsers.add_parser(
        "convert", help="convert checkpoints between HuggingFace and Megatron (torch_dist)", formatter_class=formatter,
        description="Convert HuggingFace checkpoints to megatron-sao mcore (torch_dist) checkpoints and back, "
                    "exactly, for the actor and the critic; verify a conversion by comparing outputs.",
        epilog=_FAMILIES_HELP + "\n\nSee docs/conversion.md.")
    sub = convert.add_subparsers(dest="convert_command", required=True, metavar="{hf-to-mcore,mcore-to-hf,verify}")

    h2m = sub.add_parser(
        "hf-to-mcore", help="HF checkpoint -> mcore checkpoint", formatter_class=formatter,
        description="Convert a HuggingFace checkpoint (safetensors) into a megatron-sao mcore checkpoint: a "
                    "torch_dist checkpoint training loads directly (in any TP/PP/EP layout), plus hf/ (config, "
                    "tokenizer) and sao_manifest.json (tensor tables, checksums). An actor checkpoint converted "
                    "with --role critic gets a freshly initialised value head (reported).",
        epilog=_FAMILIES_HELP)
    h2m.add_argument("--hf", required=True, metavar="DIR", help="HuggingFace checkpoint directory")
    h2m.add_argument("--out", required=True, metavar="DIR", help="output mcore checkpoint directory")
    h2m.add_argument("--role", choices=("actor", "critic"), default=None,
                     help="actor (LM head) or critic (value head); default: critic for a critic checkpoint, else actor")
    h2m.add_argument("--seed", type=int, default=1234, help="seed of an initialised value head (default 1234)")
    h2m.add_argument("--value-head-init-std", type=float_in(0.0), default=0.02,
                     help="std of an initialised value head (default 0.02)")
    _add_io_bucket_flag(h2m, "per rank, at most this many MiB of HF tensors read ahead and of tensors staged for "
                             "the torch_dist writer: peak memory is about the rank's shard plus this")
    h2m.add_argument("--io-threads", type=int_at_least(1), default=2,
                     help="torch_dist writer threads per rank, each writing and hashing one file (default 2)")
    _add_fastio_flag(h2m)
    _add_output_flags(h2m)
    _add_layout(h2m)
    h2m.set_defaults(func=run_hf_to_mcore)

    m2h = sub.add_parser(
        "mcore-to-hf", help="mcore checkpoint -> HF checkpoint", formatter_class=formatter,
        description="Export a megatron-sao mcore checkpoint as a HuggingFace checkpoint: the actor as a causal LM, "
                    "the critic as <Family>ForTokenClassification with num_labels=1 (trunk + score.weight, zero "
                    "score.bias). Tensor names, shapes and dtypes are those of the source HF checkpoint (manifest).",
        epilog="a dist checkpoint without sao_manifest.json (e.g. written by other tools) needs --hf-config.")
    m2h.add_argument("--mcore", required=True, metavar="DIR", help="mcore checkpoint directory")
    m2h.add_argument("--out", required=True, metavar="DIR", help="output HuggingFace directory")
    m2h.add_argument("--hf-config", metavar="DIR", default=None,
                     help="config + tokenizer directory to use instead of the checkpoint's hf/ copy")
    m2h.add_argument("--role", choices=("actor", "critic"), default=None,
                     help="only for checkpoints without a manifest (default actor)")
    m2h.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="export floating tensors in this dtype (default: the source's, per tensor)")
    m2h.add_argument("--max-shard-size", type=byte_size, default=byte_size("5GB"), metavar="SIZE",
                     help="largest safetensors shard (default 5GB)")
    _add_io_bucket_flag(m2h, "with --fastio: per rank, at most this many MiB loaded ahead of the export (which "
                             "gives each parameter's memory back once written)")
    _add_fastio_flag(m2h)
    _add_checksum_flag(m2h)
    _add_output_flags(m2h)
    _add_layout(m2h)
    m2h.set_defaults(func=run_mcore_to_hf)

    ver = sub.add_parser(
        "verify", help="compare HF and mcore outputs on a fixed prompt", formatter_class=formatter,
        description="Load the HF checkpoint (transformers, float32) and the mcore checkpoint (Megatron, float32, "
                    "in the given layout), run both on a fixed prompt and print the max-abs and mean-abs difference "
                    "of the logits (actor) or values (critic). Exit status 1 if max-abs exceeds --tolerance.")
    ver.add_argument("--hf", required=True, metavar="DIR", help="HuggingFace checkpoint directory")
    ver.add_argument("--mcore", required=True, metavar="DIR", help="mcore checkpoint directory")
    ver.add_argument("--prompt", default=None, help="text to run (default: a fixed chat exchange)")
    ver.add_argument("--tolerance", type=float_in(0.0), default=1e-4, help="max-abs difference accepted (default 1e-4)")
    _add_checksum_flag(ver)
    _add_log_flag(ver)
    _add_layout(ver)
    ver.set_defaults(func=run_verify)
    return convert


def main(argv: list[str] | None = None) -> int:
    """Standalone `sao`-like entry (for tools/convert_*.py), with `sao`'s exit codes."""
    import logging

    from megatron_sao.utils.console import log_path_for, run_command

    parser = SaoArgumentParser(prog="sao")
    parser.add_argument("-v", "--verbose", action="store_true", help="third-party output on the terminal")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(f"sao {args.command}", args.func, args, log_path_for(args))
