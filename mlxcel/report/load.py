"""Read every benchmark result file under the given paths into validated pandas tables.

JSONL is read line by line (so a bad line is named by its number) and CSV with ``pandas.read_csv``;
either may be gzip-compressed (``.jsonl.gz``, ``.csv.gz``: how bench/results keeps its larger row files);
every row goes through ``schema.validate_row``. Problems are collected as ``path:line: message``
and never dropped quietly. A CSV whose rows repeat rows of a JSONL file (the benchmarks write both)
is folded into the JSONL rows, which carry the environment, and the report says so.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from mlxcel.report.schema import FRAME_CSV_COLUMNS, RowError, validate_env, validate_row

REPORT_MARKER = "report.json"  # written into every report directory; such directories are not inputs


class ReportInputError(Exception):
    """Input paths that cannot be read at all (one line)."""


@dataclass
class Loaded:
    """Validated rows per tidy table, with where each came from."""

    tables: dict[str, pd.DataFrame]
    files: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, name: str) -> pd.DataFrame:
        return self.tables.get(name, pd.DataFrame())


@dataclass
class _Row:
    table: str
    values: dict[str, Any]
    env: dict[str, Any] | None
    source: str
    line: int
    columns: tuple[str, ...] = ()  # a CSV row's header: the fields it really has


def _is_report_dir(path: Path) -> bool:
    marker = path / REPORT_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("generator") == "mlxcel report"
    except (OSError, ValueError, AttributeError):
        return False


TRACE_PREFIX = "trace-"  # bench/pipeline_bench.py --trace's per-token timelines: not benchmark rows
ROW_SUFFIXES = (".jsonl", ".csv", ".jsonl.gz", ".csv.gz")


def row_kind(path: Path) -> str | None:
    """``"jsonl"`` or ``"csv"`` for a benchmark row file (plain or gzip-compressed), else None; a per-token
    trace (``trace-*.jsonl``, plain or compressed) is not one."""
    name = path.name
    if name.startswith(TRACE_PREFIX) and ".jsonl" in name:
        return None
    for suffix in ROW_SUFFIXES:
        if name.endswith(suffix):
            return suffix.split(".")[1]
    return None


def _read_text(path: Path) -> str:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return fh.read()
    return path.read_text(encoding="utf-8")


def discover(paths: Iterable[str | Path], exclude: Path | None = None) -> list[Path]:
    """Every .jsonl and .csv file (plain or .gz) under ``paths`` (files are taken as given), sorted, no
    report outputs and no per-token traces (``trace-*.jsonl``)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise ReportInputError(f"no such file or directory: {p}")
        here = [f for f in sorted(p.rglob("*")) if row_kind(f) and f.is_file()
                and not any(_is_report_dir(d) for d in f.parents if d == p or p in d.parents)
                and not (exclude and exclude.resolve() in f.resolve().parents)]
        if not here:
            raise ReportInputError(f"no .jsonl or .csv result files under {p}")
        found += here
    return list(dict.fromkeys(found))


def _read_jsonl(path: Path, problems: list[str]) -> list[_Row]:
    rows: list[_Row] = []
    try:
        text = _read_text(path)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: cannot read: {exc}")
        return rows
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(raw, dict):
            problems.append(f"{path}:{n}: expected a JSON object, got {type(raw).__name__}")
            continue
        try:
            table, values = validate_row(raw)
            env = validate_env(raw["env"]) if "env" in raw else None
            if env is None:
                raise RowError("no 'env' field (every benchmark row records its environment)")
        except RowError as exc:
            problems.append(f"{path}:{n}: {exc}")
            continue
        rows.append(_Row(table, values, env, str(path), n))
    return rows


def _read_csv(path: Path, problems: list[str]) -> list[_Row]:
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)  # compression inferred from a .gz name
    except pd.errors.EmptyDataError:
        problems.append(f"{path}: empty file")
        return []
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, EOFError) as exc:
        problems.append(f"{path}: cannot parse CSV: {str(exc).strip()}")
        return []
    if "bench" not in frame.columns:
        if not FRAME_CSV_COLUMNS <= set(frame.columns):
            problems.append(f"{path}:1: no 'bench' column and not frame_bench's columns: cannot tell which "
                            f"benchmark wrote it (columns: {', '.join(frame.columns)})")
            return []
        frame.insert(0, "bench", "frame_bench")
    rows: list[_Row] = []
    for i, raw in enumerate(frame.to_dict("records")):
        line = i + 2  # header is line 1
        try:
            table, values = validate_row(raw, from_text=True)
        except RowError as exc:
            problems.append(f"{path}:{line}: {exc}")
            continue
        rows.append(_Row(table, values, None, str(path), line, tuple(frame.columns)))
    return rows


def _key_value(v: Any) -> Any:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        return float(v)
    return str(v)


def _fold_csv_duplicates(rows: list[_Row], notes: list[str]) -> list[_Row]:
    """Drop CSV rows that repeat a JSONL row (same table, same values on the CSV's columns); say so."""
    jsonl = [r for r in rows if r.env is not None]
    kept: list[_Row] = [r for r in rows if r.env is not None]
    by_file: dict[str, list[_Row]] = {}
    for r in rows:
        if r.env is None:
            by_file.setdefault(r.source, []).append(r)
    for source, csv_rows in by_file.items():
        cols = sorted(set(csv_rows[0].columns) - {"bench"})
        index: dict[tuple, str] = {}
        for r in jsonl:
            if r.table == csv_rows[0].table:
                index.setdefault(tuple(_key_value(r.values.get(c)) for c in cols), r.source)
        matched = {}
        for r in csv_rows:
            hit = index.get(tuple(_key_value(r.values.get(c)) for c in cols))
            if hit:
                matched[id(r)] = hit
            else:
                kept.append(r)
        if matched:
            twins = ", ".join(sorted(set(matched.values())))
            rest = len(csv_rows) - len(matched)
            notes.append(f"{source}: {len(matched)} of {len(csv_rows)} rows repeat rows of {twins} "
                         f"(which carries the environment) and were taken from there"
                         + (f"; {rest} kept without environment" if rest else ""))
        else:
            notes.append(f"{source}: {len(csv_rows)} rows without environment (CSV only)")
    return kept


def _session(r: _Row) -> str:
    """One benchmark invocation: its file and the environment date it wrote (all its rows share it)."""
    date = (r.env or {}).get("date") or "no date"
    return f"{Path(r.source).name} @ {date}"


def _machine(env: dict[str, Any] | None) -> str:
    """A label that tells machines apart even when they share a hostname."""
    if not env:
        return "unknown (CSV without environment)"
    m = env.get("machine") if isinstance(env.get("machine"), dict) else {}
    host = str(env.get("host") or "?")
    if m.get("machine_id"):
        host += f" [{str(m['machine_id'])[:6]}]"
    device = str(env.get("mlx_device") or "")
    kind = "gpu" if "gpu" in device else "cpu" if "cpu" in device else device or "?"
    accel = m.get("accelerator")
    what = f"{kind}: {accel}" if accel and kind == "gpu" else kind
    return f"{host} · {what} · {env.get('cpu_count', '?')} CPUs"


def _frame(rows: list[_Row]) -> pd.DataFrame:
    records = []
    for r in rows:
        rec = {**r.values, "source_file": r.source, "source_line": r.line, "session": _session(r),
               "machine": _machine(r.env)}
        if r.env:
            env = pd.json_normalize(r.env, sep="_").iloc[0].to_dict()
            rec.update({f"env_{k}": v for k, v in env.items()})
        records.append(rec)
    return pd.DataFrame.from_records(records)


def load(paths: Iterable[str | Path], exclude: Path | None = None) -> Loaded:
    """Discover, read, validate and tabulate; problems and notes are collected, not raised."""
    problems: list[str] = []
    rows: list[_Row] = []
    files: list[dict[str, Any]] = []
    for path in discover(paths, exclude):
        before = len(problems)
        got = _read_jsonl(path, problems) if row_kind(path) == "jsonl" else _read_csv(path, problems)
        rows += got
        files.append({"file": str(path), "rows": len(got), "rejected": len(problems) - before,
                      "benches": ", ".join(sorted({r.values["bench"] for r in got}))})
    notes: list[str] = []
    rows = _fold_csv_duplicates(rows, notes)
    tables = {name: _frame([r for r in rows if r.table == name]) for name in sorted({r.table for r in rows})}
    return Loaded(tables=tables, files=files, problems=problems, notes=notes)
