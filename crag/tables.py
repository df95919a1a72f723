"""Table I/O that needs no Spark: index chunk tables in an index folder (written and read with
`deltalake`, delta-rs), the JSONL reader of documents, and `crag sql` over a local warehouse folder
(DataFusion, no JVM). crag's run tables are written by Spark through crag.warehouse.Warehouse."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from crag.errors import InputError
from crag.text import parse_json_line


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not a UTF-8 JSON object is an
    InputError naming the file and line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark
            if not raw.strip():
                continue
            row, problem = parse_json_line(raw)
            if row is None:
                raise InputError(f"{path}:{lineno}: {problem}")
            yield lineno, row


def write_table(location: str | Path, table: pa.Table) -> None:
    """Write a new Delta table (an index build's chunk table, in a folder no reader knows yet). It is
    written in a local temporary folder and then copied there as plain files: delta-rs commits with a
    hard link or a no-replace rename, which FUSE mounts such as Databricks' /Volumes do not implement
    (delta-rs issue 2540), while a finished table's files can be copied anywhere."""
    location = Path(location)
    if location.exists():
        raise FileExistsError(f"{location} exists: write_table writes new tables only")
    with tempfile.TemporaryDirectory(prefix="crag-table-") as tmp:
        write_deltalake(tmp, table)
        # contents only: file modes and times need not follow, and a FUSE mount may refuse to set them
        shutil.copytree(tmp, location, copy_function=shutil.copyfile)


def write_uc_chunk_table(name: str, chunks: pa.Table, spark) -> None:
    """The chunk table in Unity Catalog, replaced whole; change data feed on, as a Delta Sync Vector
    Search index requires of its source."""
    (
        spark.createDataFrame(chunks)
        .writeTo(name)
        .using("delta")
        .tableProperty("delta.enableChangeDataFeed", "true")
        .createOrReplace()
    )


def read_whole_table(location: str | Path) -> pa.Table:
    return DeltaTable(str(location)).to_pyarrow_table()
