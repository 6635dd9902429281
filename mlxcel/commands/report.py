"""``mlxcel report``: benchmark results -> tidy CSVs and one self-contained index.html.

Exit status: 0 written; 1 invalid input (every problem on stderr as ``file:line: message``; with
``--keep-going`` the report is written all the same, listing them) or missing dependencies;
3 regressions against ``--baseline`` when ``--fail-on-regression`` is given.
"""

from __future__ import annotations

import argparse
import sys

EXIT_REGRESSION = 3
_MISSING_DEPS = ("mlxcel report needs pandas and matplotlib, which are not installed: "
                 "pip install 'mlxcel[report]' (missing: {name})")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel report``."""
    p = subparsers.add_parser("report", help="benchmark results -> tidy CSVs and a self-contained HTML report with "
                                             "charts")
    add_report_arguments(p)
    p.set_defaults(func=run)


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="RESULTS",
                   help="result directories (searched for *.jsonl and *.csv) or files")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="report directory, e.g. reports/<run-id>")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a previous run's results or report directory to compare with")
    p.add_argument("--tolerance", type=float, default=None, metavar="FRACTION",
                   help="relative change that counts as a regression where a metric has no spread (default 0.05)")
    p.add_argument("--fail-on-regression", action="store_true",
                   help=f"exit {EXIT_REGRESSION} when the baseline comparison finds a regression")
    p.add_argument("--keep-going", action="store_true",
                   help="write the report even with invalid rows (they are listed in it; the exit status is still 1)")
    p.add_argument("--title", default="mlxcel benchmark report", help="page title")


def run(args: argparse.Namespace) -> int:
    try:
        from mlxcel.report.baseline import DEFAULT_TOLERANCE
        from mlxcel.report.build import ReportError, build_report
    except ImportError as exc:
        print(f"mlxcel: error: {_MISSING_DEPS.format(name=exc.name)}", file=sys.stderr)
        return 1
    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if not 0 <= tolerance < 1:
        print(f"mlxcel: error: --tolerance must be a fraction in [0, 1), got {tolerance}", file=sys.stderr)
        return 1
    try:
        result = build_report(args.inputs, args.out, baseline=args.baseline, tolerance=tolerance,
                              keep_going=args.keep_going, title=args.title)
    except ReportError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        print(f"mlxcel: error: {exc}", file=sys.stderr)
        return 1
    for problem in result.problems:
        print(problem, file=sys.stderr)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"mlxcel report: {result.rows} rows, {len(result.csv_files)} CSV files, "
          f"{result.regressions} regressions, {len(result.problems)} rejected -> {result.out_dir}", file=sys.stderr)
    print(result.index)
    if result.problems:
        return 1
    return EXIT_REGRESSION if args.fail_on_regression and result.regressions else 0
