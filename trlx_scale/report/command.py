"""``trlx-scale report OUTPUT_DIR [--output DIR]``."""

from __future__ import annotations

import argparse
import sys


def _report(args: argparse.Namespace) -> int:
    from .render import write_report

    try:
        report = write_report(args.output_dir, args.output)
    except (FileNotFoundError, ImportError) as error:
        print(f"trlx-scale report: {error}", file=sys.stderr)
        return 2
    print(f"report: {report.markdown}")
    for image in report.images:
        print(f"plot:   {image}")
    return 0


def add_report_parser(commands) -> None:
    report = commands.add_parser(
        "report", help="plots (PNG) and a markdown summary of a run's logged metrics (needs the 'report' extra)"
    )
    report.add_argument("output_dir", help="the run's output_dir (holds trainer_state.json or checkpoint-*/)")
    report.add_argument("--output", default=None, help="where to write (default: OUTPUT_DIR/report)")
    report.set_defaults(handler=_report)
