"""All table I/O: the questions a run reads, the tables it writes, and index chunk tables.

Two worlds, one interface:
- `delta_rs` (embedded default): Delta tables in folders under the warehouse directory, written with
  the `deltalake` package, because Spark's Delta jars cannot be downloaded offline.
- `unity_catalog` (Databricks): the warehouse is `catalog.schema`; Spark's native Delta writer and
  table names are used, so the same run lands in Unity Catalog.
Writes of run tables replace the rows of that run_id only, so re-running a run id never duplicates rows.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from crag import schema
from crag.errors import InputError

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
QUESTION_FILE_SUFFIXES = (".jsonl", ".parquet", ".csv")


def check_run_id(run_id: str) -> str:
    # fullmatch, not match with "$": "$" also matches before a final newline, so "r1\n" would pass.
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise InputError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return run_id


# ---------------------------------------------------------------- reading questions


def read_questions(path: str | Path, spark=None) -> pd.DataFrame:
    """A Delta table directory, a .jsonl/.parquet/.csv file, or (with Spark) a Unity Catalog table name.

    Every column is kept (gold columns travel with the question); ids are read as strings.
    """
    text = str(path)
    if spark is not None and not Path(text).exists() and re.fullmatch(r"[\w`]+(\.[\w`]+){1,2}", text):
        return spark.table(text).toPandas()
    path = Path(text)
    if not path.exists():
        raise InputError(f"questions not found: {path}")
    if path.is_dir():
        if not (path / "_delta_log").is_dir():
            raise InputError(f"{path} is a folder but not a Delta table (no _delta_log)")
        from deltalake import DeltaTable

        table = DeltaTable(str(path)).to_pyarrow_table()
    elif path.suffix.lower() == ".jsonl":
        return _read_jsonl(path)
    elif path.suffix.lower() == ".parquet":
        table = pq.read_table(path)
    elif path.suffix.lower() == ".csv":
        try:
            table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(strings_can_be_null=True))
        except pa.ArrowInvalid as exc:
            raise InputError(f"{path}: cannot read as CSV ({str(exc).splitlines()[0]})") from None
        # pyarrow reads a text column with invalid UTF-8 as binary rather than failing
        binary = [f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        if binary:
            raise InputError(f"{path}: column(s) {', '.join(binary)} not valid UTF-8")
    else:
        raise InputError(f"unsupported questions file {path}: expected a Delta folder or {', '.join(QUESTION_FILE_SUFFIXES)}")
    return table.to_pandas()


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


def _read_jsonl(path: Path) -> pd.DataFrame:
    # Straight to pandas: a column that mixes types (text, null, numbers) must reach validation, where
    # each bad value becomes a reject row; Arrow would refuse the whole file.
    return pd.DataFrame([row for _, row in iter_jsonl(path)])


# ---------------------------------------------------------------- Delta tables


def table_location(warehouse: str, name: str, backend: str) -> str:
    return f"{warehouse}.{name}" if backend == "unity_catalog" else str(Path(warehouse) / name)


def write_run_rows(
    warehouse: str, name: str, rows: pa.Table, run_id: str, backend: str = "delta_rs", spark=None
) -> None:
    """Replace this run's rows in table `name` (created on first write) with `rows`."""
    replace_where(warehouse, name, rows, f"run_id = '{check_run_id(run_id)}'", backend, spark)


def replace_where(warehouse: str, name: str, rows: pa.Table, predicate: str, backend: str = "delta_rs", spark=None) -> None:
    """Replace the rows of table `name` that match `predicate` (SQL) with `rows`, atomically."""
    rows = rows.select(schema.TABLES[name].names).cast(schema.TABLES[name])
    location = table_location(warehouse, name, backend)
    if backend == "unity_catalog":
        (
            spark.createDataFrame(rows)
            .write.format("delta")
            .mode("overwrite")
            .option("replaceWhere", predicate)
            .option("mergeSchema", "true")
            .saveAsTable(location)
        )
        return
    _with_commit_retries(lambda: _delta_rs_replace(location, rows, predicate))


def append_rows(warehouse: str, name: str, rows: pa.Table, backend: str = "delta_rs", spark=None) -> None:
    """Add rows to table `name` (created on first write)."""
    rows = rows.select(schema.TABLES[name].names).cast(schema.TABLES[name])
    location = table_location(warehouse, name, backend)
    if backend == "unity_catalog":
        spark.createDataFrame(rows).write.format("delta").mode("append").option("mergeSchema", "true").saveAsTable(location)
        return
    from deltalake import write_deltalake

    def write():
        Path(location).mkdir(parents=True, exist_ok=True)
        write_deltalake(location, rows, mode="append", schema_mode="merge")

    _with_commit_retries(write)


def _sql_literal(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def delete_rows(warehouse: str, name: str, run_id: str, question_ids: list[str] | None = None,
                backend: str = "delta_rs", spark=None) -> None:
    """Delete a run's rows from table `name` (only those of `question_ids`, when given)."""
    predicate = f"run_id = {_sql_literal(check_run_id(run_id))}"
    if question_ids is not None:
        if not question_ids:
            return
        predicate += f" AND question_id IN ({', '.join(_sql_literal(q) for q in question_ids)})"
    location = table_location(warehouse, name, backend)
    if backend == "unity_catalog":
        if spark.catalog.tableExists(location):
            spark.sql(f"DELETE FROM {location} WHERE {predicate}")
        return
    from deltalake import DeltaTable

    if DeltaTable.is_deltatable(location):
        _with_commit_retries(lambda: DeltaTable(location).delete(predicate))


def _delta_rs_replace(location: str, rows: pa.Table, predicate: str) -> None:
    from deltalake import DeltaTable, write_deltalake

    if DeltaTable.is_deltatable(location):
        write_deltalake(location, rows, mode="overwrite", predicate=predicate, schema_mode="merge")
    else:
        Path(location).mkdir(parents=True, exist_ok=True)
        write_deltalake(location, rows, mode="append")


def _with_commit_retries(write, attempts: int = 8) -> None:
    """delta-rs uses optimistic concurrency: a concurrent writer makes a commit fail, and the cure is to
    write again on top of the new version."""
    from deltalake.exceptions import CommitFailedError

    # Jitter spreads writers that collided, so they do not collide again in lockstep.
    for attempt in range(attempts):
        try:
            return write()
        except CommitFailedError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2**attempt * (0.5 + random.random()))


def table_exists(warehouse: str, name: str, backend: str = "delta_rs", spark=None) -> bool:
    location = table_location(warehouse, name, backend)
    if backend == "unity_catalog":
        return spark.catalog.tableExists(location)
    from deltalake import DeltaTable

    return DeltaTable.is_deltatable(location)


def read_run_rows(warehouse: str, name: str, run_id: str, backend: str = "delta_rs", spark=None) -> pd.DataFrame:
    """One run's rows of table `name`; no rows (with the table's columns) when the table does not exist yet."""
    if not table_exists(warehouse, name, backend, spark):
        return schema.TABLES[name].empty_table().to_pandas()
    return read_table(warehouse, name, backend, spark, run_id=run_id)


def read_table(warehouse: str, name: str, backend: str = "delta_rs", spark=None, run_id: str | None = None) -> pd.DataFrame:
    location = table_location(warehouse, name, backend)
    if backend == "unity_catalog":
        df = spark.table(location)
        if run_id is not None:
            df = df.where(df.run_id == run_id)
        return df.toPandas()
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(location):
        raise InputError(f"no {name} table at {location}")
    filters = [("run_id", "=", run_id)] if run_id is not None else None
    return DeltaTable(location).to_pyarrow_table(filters=filters).to_pandas()


def read_cache(warehouse: str, question_keys: list[str], backend: str = "delta_rs", spark=None) -> pd.DataFrame:
    """Stage-cache rows filed under the given questions (an empty frame when there is no cache yet)."""
    empty = schema.STAGE_CACHE.empty_table().to_pandas()
    if not question_keys or not table_exists(warehouse, "stage_cache", backend, spark):
        return empty
    location = table_location(warehouse, "stage_cache", backend)
    if backend == "unity_catalog":
        frame = spark.table(location)
        return frame.where(frame.question_key.isin(question_keys)).select("key", "question_key", "value").toPandas()
    from deltalake import DeltaTable

    return DeltaTable(location).to_pyarrow_table(columns=["key", "question_key", "value"],
                                                 filters=[("question_key", "in", question_keys)]).to_pandas()


def write_table(location: str | Path, table: pa.Table) -> None:
    """Write a whole table (index chunk tables), replacing any previous content."""
    from deltalake import write_deltalake

    Path(location).mkdir(parents=True, exist_ok=True)
    write_deltalake(str(location), table, mode="overwrite", schema_mode="overwrite")


def write_uc_chunk_table(name: str, chunks: pa.Table, spark) -> None:
    """The chunk table in Unity Catalog, replaced whole; change data feed on, as a Delta Sync Vector
    Search index requires of its source."""
    (
        spark.createDataFrame(chunks)
        .write.format("delta")
        .mode("overwrite")
        .option("overwriteSchema", "true")
        .option("delta.enableChangeDataFeed", "true")
        .saveAsTable(name)
    )


def read_whole_table(location: str | Path) -> pa.Table:
    from deltalake import DeltaTable

    return DeltaTable(str(location)).to_pyarrow_table()
