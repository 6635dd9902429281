"""HTML building blocks: formatted tables from DataFrames, and the page from its Jinja2 template.

The page is one self-contained file: inline CSS, charts as data: URIs, no scripts, no links out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2
import pandas as pd

Formatter = Callable[[Any], str]


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


def num(digits: int = 1) -> Formatter:
    return lambda v: "–" if _missing(v) else f"{v:,.{digits}f}"


def text(v: Any) -> str:
    return "–" if _missing(v) else str(v)


def micros(v: Any) -> str:
    """Microseconds the way the frame tables print them: us below 1 ms, ms above."""
    if _missing(v):
        return "–"
    return f"{v:.1f} us" if v < 1000 else f"{v / 1000:.3f} ms" if v < 10000 else f"{v / 1000:.2f} ms"


def size(v: Any) -> str:
    if _missing(v):
        return "–"
    return f"{int(v) // 2**20} MiB" if v >= 2**20 else f"{int(v) // 1024} KiB" if v >= 1024 else f"{int(v)} B"


def ratio(v: Any) -> str:
    return "–" if _missing(v) else f"{v:.2f}x"


def pct(v: Any) -> str:
    return "–" if _missing(v) else f"{v:+.1%}"


def mbytes(v: Any) -> str:
    """Decimal megabytes, as the handoff tables print sizes (4.52 MB)."""
    return "–" if _missing(v) else f"{v / 1e6:,.2f} MB"


def kib(v: Any) -> str:
    return "–" if _missing(v) else f"{v / 1024:,.1f} KiB"


def spread(digits: int = 1) -> Callable[[Any, Any], str]:
    f = num(digits)
    return lambda lo, hi: "–" if _missing(lo) else f"{f(lo)} – {f(hi)}"


@dataclass
class Table:
    """A table ready for the template: headers, rows of cell strings, and a CSS class per row."""

    headers: list[str]
    rows: list[list[str]]
    row_classes: list[str] = field(default_factory=list)
    numeric: list[bool] = field(default_factory=list)


Column = tuple[str, "str | tuple[str, str]", Callable[..., str]]


def table(df: pd.DataFrame, columns: list[Column], row_class: Callable[[pd.Series], str] | None = None) -> Table:
    """``columns``: (header, column or (low, high) pair, formatter) per shown column."""
    rows, classes = [], []
    for _, r in df.iterrows():
        rows.append([fmt(*(r[c] for c in col)) if isinstance(col, tuple) else fmt(r[col]) for _, col, fmt in columns])
        classes.append(row_class(r) if row_class else "")
    numeric = [fmt is not text for _, _, fmt in columns]
    return Table([h for h, _, _ in columns], rows, classes, numeric)


def render(context: dict[str, Any]) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("mlxcel.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html").render(**context)
