"""``stacklm report``: a run's loss, mix, drops, document lengths and padding as one HTML page
(``stacklm.run_report``)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  stacklm report artifacts/demo                      # writes artifacts/demo/report.html (+ report_files/*.png)
  stacklm report runs/stack-100m --out /tmp/run.html
"""


def cmd_report(args: argparse.Namespace) -> int:
    from stacklm.run_report import write_report

    path = write_report(args.run, args.out)
    print(f"report: {path} (pictures in {path.parent / (path.stem + '_files')})")
    return 0


def add_report_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``stacklm report`` on the CLI's subparsers (``parser.build_parser``)."""
    p = subparsers.add_parser(
        "report", help="draw a training run from its own logs (CSV metrics + data_stats.json) into one HTML page",
        description="Loss curve, realized vs target mix over the steps, drops by reason, document-length histograms "
        "per source and padding, from the metrics.csv files of a run's CSVLogger and the data_stats.json beside them.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="the run's folder (trainer.default_root_dir, or the CSV logger's save_dir)")
    p.add_argument("--out", help="the HTML file to write (default: RUN/report.html)")
    p.set_defaults(func=cmd_report)
    return p
