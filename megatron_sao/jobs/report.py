"""`sao report RUN_DIR [--out DIR]`: render a run's curves to PNG files and one HTML page.

The work is in `megatron_sao/reporting/`; this is the sub-command. The page's path is the last
line printed (scripts and `make demo` read it).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_report(args: argparse.Namespace) -> int:
    from megatron_sao.reporting.report import write_report

    report = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    missing = ", ".join(report.not_logged) or "nothing"
    print(f"sao report: {len(report.figures)} figures; not logged: {missing}", flush=True)
    print(report.page, flush=True)
    return 0


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao report` on the `sao` sub-command parsers."""
    report = subparsers.add_parser(
        "report", help="render a run's curves (PNG) and one HTML page",
        description="Read RUN_DIR/metrics.jsonl and write one PNG per panel (reward, success, response "
                    "length, critic explained variance, DIS masked fractions, staleness and its histogram, "
                    "throughput, rollout accounting, buffer wait times, losses) and a self-contained "
                    "index.html referencing them, into RUN_DIR/report/. Panels whose metrics the run did not "
                    "log are listed as not logged. Prints the page's path as its last line. Exit 2 when "
                    "RUN_DIR has no metrics.jsonl. See docs/report.md.",
    )
    report.add_argument("run_dir", help="a run directory (run.output_dir/run.name) holding metrics.jsonl")
    report.add_argument("--out", default=None, help="directory to write into (default: RUN_DIR/report)")
    report.set_defaults(func=_cmd_report)
    return report
