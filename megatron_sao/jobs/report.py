"""`sao report RUN_DIR [--out DIR]`: render a run's curves to PNG files and one HTML page.

The work is in `megatron_sao/reporting/`; this is the sub-command. The page's path is the last
line printed (scripts and `make demo` read it).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_report(args: argparse.Namespace) -> int:
    from megatron_sao.jobs.preflight import check_writable_dir
    from megatron_sao.reporting.report import write_report

    if args.out:
        check_writable_dir(Path(args.out), "--out")

    if args.compare:
        from megatron_sao.reporting.compare import write_comparison

        run_dirs = [Path(args.run_dir), *(Path(d) for d in args.compare)]
        out = Path(args.out) if args.out else run_dirs[0] / "comparison"
        # Runs are labelled by directory name, or by path where names repeat (runs1/x vs runs2/x).
        names = [d.name for d in run_dirs]
        labels = {(d.name if names.count(d.name) == 1 else str(d)): d for d in run_dirs}
        comparison = write_comparison(labels, out, phase_steps=args.phase_steps)
        print(f"sao report: {len(comparison.figures)} comparison figures of {len(run_dirs)} runs", flush=True)
        print(comparison.page, flush=True)
        return 0
    report = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    missing = ", ".join(report.not_logged) or "nothing"
    print(f"sao report: {len(report.figures)} figures; not logged: {missing}", flush=True)
    print(report.page, flush=True)
    return 0


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao report` on the `sao` sub-command parsers."""
    from megatron_sao.utils.args import int_at_least

    report = subparsers.add_parser(
        "report", help="render a run's curves (PNG) and one HTML page",
        description="Read RUN_DIR/metrics.jsonl and write one PNG per panel (reward, success, response "
                    "length, critic explained variance, DIS masked fractions, staleness and its histogram, "
                    "throughput, rollout accounting, buffer wait times, losses) and a self-contained "
                    "index.html referencing them, into RUN_DIR/report/. Panels whose metrics the run did not "
                    "log are listed as not logged. Prints the page's path as its last line. A cut last line of "
                    "metrics.jsonl (a running or killed run) is skipped with a warning. Exit 2 when RUN_DIR has no "
                    "metrics.jsonl (the run directories below it are listed, e.g. `sao demo`'s stages), a line of "
                    "it is malformed or not UTF-8, or --out cannot be written. See docs/report.md.",
    )
    report.add_argument("run_dir", help="a run directory (run.output_dir/run.name) holding metrics.jsonl")
    report.add_argument("--out", default=None, help="directory to write into (default: RUN_DIR/report, or "
                                                    "RUN_DIR/comparison with --compare)")
    report.add_argument("--compare", nargs="+", metavar="OTHER_RUN_DIR", default=None,
                        help="draw these runs beside RUN_DIR instead (reward, success, critic EV overlaid; "
                             "reporting/compare.py)")
    report.add_argument("--phase-steps", type=int_at_least(1), default=None,
                        help="with --compare: steps per phase of a shifting reward (online mode): boundaries "
                             "drawn, adaptation per phase tabulated")
    report.set_defaults(func=_cmd_report)
    return report
