"""`crag sql`: read-only SQL over a local warehouse's Delta tables, with a time limit.

DataFusion (through delta-rs) can write: `COPY t TO 'path'` overwrites any file, a Delta log
included. So a query is parsed first, with sqlparser-rs (sqloxide), the parser DataFusion itself is
built on, and only one statement that reads is run: a query (SELECT / WITH / VALUES), EXPLAIN of one,
SHOW TABLES / COLUMNS or DESCRIBE. What the parser cannot read is refused, never guessed at.

The query runs in a child process, so a runaway one (a cross join, generate_series over 1e11 rows) is
stopped at the time limit by ending that process: a thread inside DataFusion cannot be stopped. The
child sends its result back as an Arrow IPC stream.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import sqloxide
from deltalake import DeltaTable, QueryBuilder

from crag import schema
from crag.errors import InputError, describe

log = logging.getLogger("crag")

DEFAULT_TIMEOUT_S = 60.0
_NOTE = "crag sql note: "  # a line of the child's stderr that the parent logs as a warning
READING_STATEMENTS = frozenset({"Query", "Explain", "ExplainTable", "ShowTables", "ShowColumns"})
# Anything that writes or changes state, also when nested in a query (a data-modifying CTE).
_WRITING_NODES = frozenset(
    {
        "Insert",
        "Update",
        "Delete",
        "Merge",
        "Copy",
        "CopyIntoSnowflake",
        "CreateTable",
        "CreateView",
        "CreateExternalTable",
        "Drop",
        "Truncate",
        "AlterTable",
        "Set",
        "SetVariable",
        "Unload",
        "Directory",
        "Call",
        "Execute",
    }
)


def check_read_only(sql: str) -> None:
    """Refuse, as an InputError, anything but a single statement that only reads."""
    try:
        statements = sqloxide.parse_sql(sql, dialect="generic")
    except ValueError as exc:
        detail = " ".join(str(exc).split())
        raise InputError(f"SQL not run: it could not be read as a query ({detail})") from None
    if len(statements) != 1:
        raise InputError(f"SQL not run: give exactly one statement, got {len(statements)}")
    [statement] = statements
    kind = next(iter(statement))
    if kind not in READING_STATEMENTS:
        raise InputError(
            f"SQL not run: crag sql only reads (SELECT, WITH, EXPLAIN, SHOW, DESCRIBE), got {_words(kind)}"
        )
    if kind == "Explain":  # EXPLAIN ANALYZE runs its statement: it must be a query too
        inner = statement["Explain"].get("statement")
        inner_kind = next(iter(inner)) if isinstance(inner, dict) and inner else None
        if inner_kind != "Query":
            raise InputError(f"SQL not run: EXPLAIN only of a query, got {_words(str(inner_kind))}")
    writing = _find_writing(statement)
    if writing:
        raise InputError(f"SQL not run: crag sql only reads; the query contains {_words(writing)}")


def _words(kind: str) -> str:
    """sqlparser's statement kind as SQL words: CreateTable -> CREATE TABLE."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", kind).upper()


def _find_writing(node: Any) -> str | None:
    """The first node of the parsed statement that writes, searched without recursion: a query of a
    few thousand UNIONs nests deeper than Python's recursion limit."""
    pending = [node]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key in node:
                if key in _WRITING_NODES:
                    return key
            pending.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            pending.extend(reversed(node))
    return None


def _tables(warehouse: Path) -> list[Path]:
    found = [p for p in sorted(warehouse.iterdir()) if (p / "_delta_log").is_dir()] if warehouse.is_dir() else []
    if not found:
        raise InputError(f"no Delta tables under {warehouse}")
    return found


def query(warehouse: str | Path, sql: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> pa.Table:
    """Run one read-only SQL statement (DataFusion dialect) over every crag table present in a local
    warehouse, each registered under its folder's name (answers, grades, decisions, runs, ...). Stopped
    after `timeout_s` seconds."""
    warehouse = Path(warehouse)
    check_read_only(sql)
    _tables(warehouse)  # no tables: say so before starting a process
    try:
        child = subprocess.run(
            [sys.executable, "-m", "crag.sql", str(warehouse)],
            input=sql.encode("utf-8"),
            capture_output=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},  # its messages come back as UTF-8, whatever the locale
        )
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child
        raise InputError(f"SQL stopped after {timeout_s:g} s (the time limit; raise it with --timeout)") from None
    if child.returncode != 0:
        lines = child.stderr.decode("utf-8", "replace").strip().splitlines()
        if lines:
            raise InputError(lines[-1])
        if child.returncode < 0:  # killed by a signal: DataFusion overflows its stack on very deep queries
            name = signal.Signals(-child.returncode).name
            raise InputError(
                f"SQL failed: the query process was killed by {name} (a query nested very deeply, such as "
                "thousands of UNIONs, can exhaust the query engine's stack)"
            )
        raise InputError(f"SQL failed: the query process ended with code {child.returncode}")
    for line in child.stderr.decode("utf-8", "replace").splitlines():
        if line.startswith(_NOTE):
            log.warning("%s", line.removeprefix(_NOTE))
    with pa.ipc.open_stream(child.stdout) as reader:
        return _plain_types(reader.read_all())


def _plain_types(result: pa.Table) -> pa.Table:
    return result.cast(pa.schema([f.with_type(_plain(f.type)) for f in result.schema]))


def _plain(kind: pa.DataType) -> pa.DataType:
    """`kind` with DataFusion's view types (string_view, list_view, ..., also nested, as array_agg
    returns them) made plain ones, which pandas can convert."""
    if pa.types.is_string_view(kind):
        return pa.large_string()
    if pa.types.is_binary_view(kind):
        return pa.large_binary()
    if pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind) or pa.types.is_large_list(kind):
        return pa.large_list(_plain(kind.value_type))
    if pa.types.is_list(kind):
        return pa.list_(_plain(kind.value_type))
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(_plain(kind.value_type), kind.list_size)
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_plain(field.type)) for field in kind])
    if pa.types.is_map(kind):
        return pa.map_(_plain(kind.key_type), _plain(kind.item_type))
    return kind


def session(warehouse: Path) -> tuple[QueryBuilder, list[str], list[str]]:
    """A DataFusion session over a local warehouse: its stored tables, each registered under its
    folder's name, and crag's views over them (answers, grades, ...: crag.schema.VIEWS, in DataFusion's
    SQL). With the names registered, and those of tables that could not be opened."""
    found = _tables(warehouse)
    # SHOW TABLES / COLUMNS read DataFusion's information_schema, which a session leaves off
    builder = QueryBuilder({"datafusion.catalog.information_schema": "true"})
    registered, left_out = [], []
    for path in found:  # a table that cannot be opened (a run killed while creating it) fails only its own queries
        try:
            builder.register(path.name, DeltaTable(str(path)))
            registered.append(path.name)
        except Exception as exc:
            left_out.append(path.name)
            print(
                f"{_NOTE}left out table {path.name}: it cannot be opened ({describe(exc, limit=200)})", file=sys.stderr
            )
    for name, view in schema.VIEWS.items():
        if {view.stored, "runs"} <= set(registered) and name not in registered:
            builder.execute(f"CREATE VIEW {name} AS {view.sql(str, explode='unnest')}")
            registered.append(name)
    return builder, registered, left_out


def read_table(warehouse: str | Path, name: str) -> pa.Table:
    """A table or view of a local warehouse, whole, read in this process (tests, benchmarks)."""
    if name not in schema.TABLES:
        raise InputError(f"no crag table {name!r}")
    builder, _, _ = session(Path(warehouse))
    return _plain_types(pa.table(builder.execute(f"SELECT * FROM {name}").read_all()))


def _run_in_child(warehouse: Path, sql: str) -> int:
    """The child's side: run the query, write the result to stdout as an Arrow IPC stream, or one line
    to stderr."""
    builder, registered, left_out = session(warehouse)
    try:
        # Reading the batches is where a query fails at run time (a cast of bad text, ...), so it is
        # inside the same handler as planning.
        result = pa.table(builder.execute(sql).read_all())
    except Exception as exc:  # DataFusion reports SQL errors as plain exceptions
        tables = ", ".join(registered) + (f"; left out, unreadable: {', '.join(left_out)}" if left_out else "")
        print(f"SQL failed: {describe(exc, limit=500, with_type=False)} (tables: {tables})", file=sys.stderr)
        return 2
    with pa.ipc.new_stream(sys.stdout.buffer, result.schema) as writer:
        writer.write_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(_run_in_child(Path(sys.argv[1]), sys.stdin.buffer.read().decode("utf-8")))  # as the parent sends it
