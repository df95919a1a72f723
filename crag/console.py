"""Tables for people and for programs: `--format table|csv|json|markdown` of `crag sql` and `crag eval`.

- table: fits the terminal (or `width`). Text is left-aligned and cut with an ellipsis; numbers are
  right-aligned, and neither they nor times are cut (floats as the shortest text that reads back as
  the same value, unless the caller gives a format: crag eval's three decimals). Widths are display columns, so CJK characters
  count two. When the columns cannot all fit, they continue in further blocks below, each repeating
  the first column.
  One line per row: line breaks and tabs inside a value show as spaces, and bidi controls (RLO, ...)
  as escapes (\u202e), so that no value reorders the line.
- csv: RFC 4180 with a header line; nested values (lists, structs) as JSON; nulls empty.
- json: JSON Lines, one object per row, so a large result streams and `jq` reads it as it is (bidi
  controls written as JSON escapes: the same values).
- markdown: a GitHub table (numbers right-aligned), nothing cut, `|` escaped.

Pure functions over a pandas DataFrame or an Arrow table; the caller prints the string.
"""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import json
import math
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import regex
from wcwidth import wcwidth

from crag.errors import InputError
from crag.evaluation import METRICS, SLICE_VALUES, SLICES

FORMATS = ("table", "csv", "json", "markdown")
ELLIPSIS = "…"
COLUMN_GAP = "  "
MIN_TEXT_WIDTH = 6  # a text column is cut no narrower than this, so a few characters stay readable
BLOCK_TEXT_WIDTH = 24  # when the table is split into blocks, each text column gets up to this much room
FALLBACK_WIDTH = 120  # when the output is not a terminal and COLUMNS is unset


@dataclass
class _Grid:
    columns: list[str]
    numeric: list[bool]
    temporal: list[bool]
    rows: list[list]  # plain Python values: None, bool, int, float, str, datetime, list, dict


def _plain(value):
    """A cell as plain Python: numpy scalars and arrays, pandas' missing values and timestamps unwrapped."""
    if value is None or value is pd.NaT:
        return None
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, pd.Timestamp):
        return value.to_pydatetime()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _grid(data: pd.DataFrame | pa.Table) -> _Grid:
    if isinstance(data, pa.Table):
        types = data.schema.types
        numeric = [pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) for t in types]
        columns = [c.to_pylist() for c in data.columns]
        return _Grid(
            [str(n) for n in data.column_names],
            numeric,
            [pa.types.is_temporal(t) for t in types],
            [list(r) for r in zip(*columns)],
        )
    if isinstance(data, pd.DataFrame):
        numeric = [pd.api.types.is_numeric_dtype(t) and not pd.api.types.is_bool_dtype(t) for t in data.dtypes]
        temporal = [
            pd.api.types.is_datetime64_any_dtype(t) or pd.api.types.is_timedelta64_dtype(t) for t in data.dtypes
        ]
        rows = [[_plain(v) for v in row] for row in data.itertuples(index=False, name=None)]
        return _Grid([str(c) for c in data.columns], numeric, temporal, rows)
    raise TypeError(f"expected a pandas DataFrame or an Arrow table, got {type(data).__name__}")


def _json_default(value):
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


# Unicode's Bidi_Control characters (RLO, LRI, ...): in a value they would reorder the terminal's line
# around it. Shown as escapes: \u202e in a table or markdown cell, and in JSON, where the escape is
# the same value. CSV has no escapes: its values stay exact, for the programs that read it.
_BIDI_CONTROL = regex.compile(r"\p{Bidi_Control}")


def _bidi_escaped(text: str) -> str:
    return _BIDI_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _json(value) -> str:
    return _bidi_escaped(json.dumps(value, ensure_ascii=False, default=_json_default, separators=(",", ":")))


def _round_trip(value: float) -> str:
    """The shortest text that reads back as the same float: a query's result shown without a digit cut
    (1234567.25 stays that, where 6 significant digits printed 1.23457e+06)."""
    return repr(value)


def _cell(value, null: str, float_format: Callable[[float], str]) -> str:
    """A value as one line of text."""
    if value is None:
        return null
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return float_format(value) if math.isfinite(value) else str(value)
    if isinstance(value, (list, dict)):
        text = _json(value)
    else:
        text = str(value)
    return _bidi_escaped(
        "".join(" " if ch in "\r\n\t\v\f" or (ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0) else ch for ch in text)
    )


# ---------------------------------------------------------------- display width


def _char_width(ch: str) -> int:
    return max(0, wcwidth(ch))  # combining marks 0, CJK and other wide characters 2


def display_width(text: str) -> int:
    """Terminal columns the text takes."""
    return sum(_char_width(ch) for ch in text)


def fit(text: str, width: int, align: str = "left") -> str:
    """The text padded to exactly `width` columns, or cut to width - 1 columns plus an ellipsis."""
    used = display_width(text)
    if used > width:
        kept, used = [], 0
        for ch in text:
            w = _char_width(ch)
            if used + w > width - 1:
                break
            kept.append(ch)
            used += w
        text = "".join(kept) + ELLIPSIS
        used += 1
    pad = " " * (width - used)
    return pad + text if align == "right" else text + pad


def terminal_width() -> int:
    """Columns of the terminal on stdout; $COLUMNS, or FALLBACK_WIDTH when stdout is not a terminal."""
    return shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns


# ---------------------------------------------------------------- formats


def _column_blocks(minimum: list[int], roomy: list[int], width: int) -> list[list[int]]:
    """All columns in one block when they fit at their minimum widths; else blocks that fit at `roomy`
    widths, so that text keeps some room. Every block after the first starts with column 0 again, so
    each row can still be told apart."""
    gap = len(COLUMN_GAP)
    if sum(minimum) + gap * (len(minimum) - 1) <= width:
        return [list(range(len(minimum)))]
    blocks, block, used = [], [0], roomy[0]
    for i in range(1, len(roomy)):
        if len(block) > 1 and used + gap + roomy[i] > width:
            blocks.append(block)
            block, used = [0], roomy[0]
        block.append(i)
        used += gap + roomy[i]
    blocks.append(block)
    return blocks


def _shrink(widths: list[int], minimum: list[int], width: int) -> list[int]:
    """Narrow the widest text columns, one column at a time, until the line fits or none can narrow."""
    widths = list(widths)
    excess = sum(widths) + len(COLUMN_GAP) * (len(widths) - 1) - width
    while excess > 0:
        shrinkable = [i for i in range(len(widths)) if widths[i] > minimum[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        others = [widths[i] for i in shrinkable if i != widest]
        # down to the next-widest column (so wide columns even out), the minimum, or just enough
        step = max(1, min(excess, widths[widest] - max([minimum[widest], *others])))
        widths[widest] -= step
        excess -= step
    return widths


def _table(grid: _Grid, width: int, null: str, float_format) -> str:
    if not grid.columns:
        return "(no columns)"
    cells = [[_cell(v, null, float_format) for v in row] for row in grid.rows]
    headers = [_cell(c, "", float_format) for c in grid.columns]
    natural = [max([display_width(headers[i]), *(display_width(r[i]) for r in cells)]) for i in range(len(headers))]
    fixed = [num or time for num, time in zip(grid.numeric, grid.temporal)]  # never cut
    minimum = [n if keep else min(n, MIN_TEXT_WIDTH) for n, keep in zip(natural, fixed)]
    roomy = [n if keep else min(n, BLOCK_TEXT_WIDTH) for n, keep in zip(natural, fixed)]
    out: list[str] = []
    for block in _column_blocks(minimum, roomy, width):
        widths = _shrink([natural[i] for i in block], [minimum[i] for i in block], width)
        aligns = ["right" if grid.numeric[i] else "left" for i in block]

        def line(values: list[str]) -> str:
            return COLUMN_GAP.join(fit(v, w, a) for v, w, a in zip(values, widths, aligns)).rstrip()

        if out:
            out.append("")
        out.append(line([headers[i] for i in block]))
        out.append(COLUMN_GAP.join("-" * w for w in widths))
        out.extend(line([r[i] for i in block]) for r in cells)
    return "\n".join(out)


def _csv(grid: _Grid) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(grid.columns)
    for row in grid.rows:
        writer.writerow(
            [
                ""
                if v is None
                else _json(v)
                if isinstance(v, (list, dict))
                else ("true" if v else "false")
                if isinstance(v, bool)
                else v.isoformat()
                if isinstance(v, (datetime.datetime, datetime.date))
                else v
                for v in row
            ]
        )
    return buffer.getvalue().rstrip("\n")


def _json_lines(grid: _Grid) -> str:
    def finite(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v  # JSON has no NaN or Infinity

    return "\n".join(_json({c: finite(v) for c, v in zip(grid.columns, row)}) for row in grid.rows)


def _markdown(grid: _Grid, null: str, float_format) -> str:
    def row(values: Iterable[str]) -> str:
        return "| " + " | ".join(v.replace("\\", "\\\\").replace("|", "\\|") for v in values) + " |"

    lines = [
        row(_cell(c, "", float_format) for c in grid.columns),
        "|" + "|".join(" ---: " if num else " --- " for num in grid.numeric) + "|",
    ]
    lines += [row(_cell(v, null, float_format) for v in r) for r in grid.rows]
    return "\n".join(lines)


def render(
    data: pd.DataFrame | pa.Table,
    fmt: str = "table",
    width: int | None = None,
    null: str = "",
    float_format: Callable[[float], str] = _round_trip,
) -> str:
    """The table as text in one of FORMATS. `width` (table only): columns to fit, default the
    terminal's. `null` and `float_format` shape the table and markdown cells; csv and json keep values
    exact."""
    grid = _grid(data)
    if fmt == "table":
        return _table(grid, width or terminal_width(), null, float_format)
    if fmt == "csv":
        return _csv(grid)
    if fmt == "json":
        return _json_lines(grid)
    if fmt == "markdown":
        return _markdown(grid, null, float_format)
    raise InputError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")


# ---------------------------------------------------------------- crag eval's metrics


def slice_names(spec: str | Sequence[str]) -> list[str]:
    """The names in a --slices spec, each checked against the slice keys a run can have (InputError
    names a wrong one): `crag eval` checks them before it computes and writes the metrics."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise InputError("--slices names no slice")
    for name in names:
        key, is_value, value = name.partition("=")
        if name != "all" and key not in SLICES:
            raise InputError(
                f"unknown slice {name!r}: a slice is all, or one of {', '.join(SLICES)} (key or key=value)"
            )
        if is_value and value not in SLICE_VALUES.get(key, ()):
            raise InputError(f"unknown slice {name!r}: {key} is one of {', '.join(SLICE_VALUES[key])}")
    return names


def select_slices(metrics: pd.DataFrame, spec: str | Sequence[str] | None = None) -> list[str]:
    """The slices named in `spec` ("language=en,language=ja"; a bare key such as "language" means all of
    its slices; "all" is the whole run), in the order given; None: "all", then every slice sorted."""
    available = list(dict.fromkeys(metrics["slice"]))
    if spec is None:
        return ["all"] + sorted(s for s in available if s != "all")
    names = slice_names(spec)
    chosen: list[str] = []
    for name in names:
        matches = [name] if name in available else sorted(s for s in available if s.startswith(f"{name}="))
        if not matches:
            raise InputError(
                f"unknown slice {name!r}: this run has {', '.join(['all'] + sorted(set(available) - {'all'}))}"
            )
        chosen += [m for m in matches if m not in chosen]
    return chosen


def metrics_frame(metrics: pd.DataFrame, slices: Sequence[str]) -> pd.DataFrame:
    """metric x slice: a `metric` column, then one column of values per slice (NaN where a metric does
    not apply to a slice), metrics in crag.evaluation's order."""
    wanted = metrics[metrics["slice"].isin(list(slices))]
    pivot = wanted.pivot(index="metric", columns="slice", values="value").reindex(columns=list(slices))
    order = [m for m in METRICS if m in pivot.index]
    frame = pivot.loc[order].reset_index()
    frame.columns.name = None
    return frame


def render_metrics(
    metrics: pd.DataFrame, slices: str | Sequence[str] | None = None, fmt: str = "table", width: int | None = None
) -> str:
    """`crag eval`'s output. table and markdown: metric x slice, three decimals, "-" where a metric does
    not apply. csv and json: the long rows (metric, slice, value, n) of the chosen slices, which keep
    how many questions or documents stand behind each value."""
    chosen = select_slices(metrics, slices)
    if fmt in ("csv", "json"):
        order = {m: i for i, m in enumerate(METRICS)}
        rank = {s: i for i, s in enumerate(chosen)}
        rows = metrics[metrics["slice"].isin(chosen)]
        rows = rows.assign(_m=rows["metric"].map(order), _s=rows["slice"].map(rank)).sort_values(["_m", "_s"])
        return render(rows[["metric", "slice", "value", "n"]].reset_index(drop=True), fmt)
    return render(metrics_frame(metrics, chosen), fmt, width, null="-", float_format=lambda v: f"{v:.3f}")
