"""Table I/O that needs no Spark: index chunk tables in an index folder (written and read with
`deltalake`, delta-rs), the JSONL reader of documents, and `crag sql` over a local warehouse folder
(DataFusion, no JVM). crag's run tables are written by Spark through crag.warehouse.Warehouse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from crag.errors import InputError


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not a UTF-8 JSON object is an
    InputError naming the file and line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise InputError(f"{path}:{lineno}: not valid UTF-8") from None
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object per line")
            yield lineno, row


def write_table(location: str | Path, table: pa.Table) -> None:
    """Write a whole table (index chunk tables), replacing any previous content."""
    from deltalake import write_deltalake

    Path(location).mkdir(parents=True, exist_ok=True)
    write_deltalake(str(location), table, mode="overwrite", schema_mode="overwrite")


def write_uc_chunk_table(name: str, chunks: pa.Table, spark) -> None:
    """The chunk table in Unity Catalog, replaced whole; change data feed on, as a Delta Sync Vector
    Search index requires of its source."""
    (spark.createDataFrame(chunks).writeTo(name).using("delta")
     .tableProperty("delta.enableChangeDataFeed", "true").createOrReplace())


def read_whole_table(location: str | Path) -> pa.Table:
    from deltalake import DeltaTable

    return DeltaTable(str(location)).to_pyarrow_table()


def query(warehouse: str | Path, sql: str) -> pa.Table:
    """Run SQL (DataFusion dialect) over every crag table present in a local warehouse; each table is
    registered under its name (answers, grades, decisions, runs, rejects, and comparisons later)."""
    from deltalake import DeltaTable, QueryBuilder
    from deltalake.exceptions import DeltaError

    warehouse = Path(warehouse)
    builder = QueryBuilder()
    found = [p for p in sorted(warehouse.iterdir()) if (p / "_delta_log").is_dir()] if warehouse.is_dir() else []
    if not found:
        raise InputError(f"no Delta tables under {warehouse}")
    for path in found:
        builder.register(path.name, DeltaTable(str(path)))
    try:
        result = builder.execute(sql)
    except (DeltaError, Exception) as exc:  # DataFusion reports SQL errors as plain exceptions
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"SQL failed: {first} (tables: {', '.join(p.name for p in found)})") from None
    return pa.table(result.read_all())
