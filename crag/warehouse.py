"""The Warehouse: one object that names crag's tables and owns the Spark session that reads and
writes them (Kedro's DataCatalog is the model: `warehouse.load("answers")`, `warehouse.append(...)`).

What is stored and what is shown are declared once, in crag.schema: each run writes its rows into the
stored tables `inputs`, `results` and `metric_values` under a new generation, and the tables users
query (`answers`, `grades`, `decisions`, `rejects`, `gold`, `metrics`) are views that show each run's
`shown_generation` (crag.schema.View). Recording a run's outcome in `runs` is what shows its rows: a
re-run's rows replace the earlier ones in that one commit, and a run that fails shows none of its own.

Every table is written by Spark's own Delta writer, on classic Spark and on Spark Connect alike:
- a Unity Catalog (or any catalog) schema, given as `catalog.schema`: tables are
  `catalog.schema.<name>`, managed by the catalog, and the views are catalog views;
- a local folder: each stored table is the Delta table at `<folder>/<name>`, named by its path
  (delta.`<folder>/<name>`), which Delta's catalog resolves without registering anything: a name that
  is the folder's own by construction, and no catalog request per table and command (registering five
  tables took seconds of a run's start). The folder layout is plain Delta: `crag sql` reads it without
  a JVM and defines the views itself (crag.sql).

Values never enter SQL text: rows are written and removed with Column conditions (DataFrameWriterV2
`overwrite(condition)`), merges take their values from a source frame (`Merge`), and identifiers are
validated and quoted.
"""

from __future__ import annotations

import logging
import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from crag import schema
from crag.catalog import ensure_schema
from crag.config import TablesConfig
from crag.errors import CragError, InputError

log = logging.getLogger("crag")

_CATALOG_SCHEMA = re.compile(r"`?[A-Za-z_][A-Za-z0-9_-]*`?\.`?[A-Za-z_][A-Za-z0-9_-]*`?")


def quote(identifier: str) -> str:
    """A backquoted SQL identifier (a backquote inside is doubled)."""
    return "`" + identifier.replace("`", "``") + "`"


def is_catalog_schema(location: str) -> bool:
    """`catalog.schema` (Unity Catalog), as opposed to a local folder (a folder of that name that holds
    nothing but the MLflow store an older crag left there for the catalog schema is no warehouse)."""
    if not _CATALOG_SCHEMA.fullmatch(location):
        return False
    return not Path(location).exists() or left_store_folder(location)


def left_store_folder(location: str) -> bool:
    """Whether `location` is a folder that holds nothing but an MLflow store: one that an earlier crag
    made in the working directory for a catalog.schema warehouse, and then took for a warehouse folder
    of that name. It is no warehouse: the name is the catalog schema's."""
    folder = Path(location)
    return (
        folder.is_dir()
        and [p.name for p in folder.iterdir()] == ["mlflow"]
        and (folder / "mlflow" / "mlflow.db").is_file()
    )


def is_conflict(exc: Exception) -> bool:
    """Delta's optimistic concurrency: another writer committed first (or created the table first);
    writing again on top of the new version is the cure. On Spark Connect the Java class arrives only
    as text, so the error's class name, condition and message are all looked at."""
    condition = getattr(exc, "getCondition", None) or getattr(exc, "getErrorClass", None)
    text = f"{type(exc).__name__} {exc} {condition() if callable(condition) else ''} {getattr(exc, 'desc', '')}"
    return any(
        word in text
        for word in (
            "ConcurrentAppend",
            "ConcurrentDeleteRead",
            "ConcurrentDeleteDelete",
            "ConcurrentTransaction",
            "ProtocolChanged",
            "MetadataChanged",
            "DELTA_CONCURRENT",
            "already exists",
            "TABLE_OR_VIEW_ALREADY_EXISTS",
            # another process is creating the table there: its files are in, its first commit not yet
            "DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION",
            "CommitFailedError",  # delta-rs (a local table's creation): another creator committed first
        )
    )


def in_generation(run_id: str, generation: str):
    """The condition (a Column) that picks the rows of one generation of a run."""
    from pyspark.sql import functions as F

    return (F.col("run_id") == F.lit(run_id)) & (F.col("generation") == F.lit(generation))


def has_delta_log(path: Path) -> bool:
    """Whether a folder holds a Delta table: a log with a commit (a creation under way has the log's
    folder before its first commit)."""
    return any((path / "_delta_log").glob("*.json"))


_AGAIN = object()  # an attempt's outcome that asks for another attempt


def _retried_on_conflict(attempt, attempts: int = 8):
    """attempt() until it returns something other than _AGAIN, again when another writer committed
    first (is_conflict), with exponential backoff and jitter (colliding writers drift apart); the
    last attempt's error, or _AGAIN, when every attempt was used."""
    for number in range(attempts):
        try:
            outcome = attempt()
            if outcome is not _AGAIN:
                return outcome
        except Exception as exc:
            if not is_conflict(exc) or number == attempts - 1:
                raise
        time.sleep(0.05 * 2**number * (1 + random.random()))
    return _AGAIN


# ------------------------------------------------------------------ merges


@dataclass(frozen=True)
class Condition:
    """A MERGE condition over the target row `t` and the source row `s`: column names only, every
    value comes from the source row. Combine with `|`."""

    sql: str

    def __or__(self, other: Condition) -> Condition:
        return Condition(f"({self.sql}) OR ({other.sql})")

    def __and__(self, other: Condition) -> Condition:
        return Condition(f"({self.sql}) AND ({other.sql})")


def target_differs(column: str) -> Condition:
    """The target row's `column` is not the source row's."""
    return Condition(f"t.{quote(column)} <> s.{quote(column)}")


def target_matches(column: str, source_column: str) -> Condition:
    """The target row's `column` equals the source row's `source_column`, nulls equal to nulls."""
    return Condition(f"t.{quote(column)} <=> s.{quote(source_column)}")


@dataclass
class Merge:
    """A MERGE of a few source rows into a stored table, built like delta-rs's
    `merge(...).when_matched_update(...).when_not_matched_insert_all().execute()`; the Warehouse
    writes it as SQL over quoted column names. Source rows match target rows that agree on every `on`
    column (the table's key by default)."""

    warehouse: Warehouse
    table: str
    rows: Any  # a DataFrame with the table's columns, and any a condition reads
    on: tuple[str, ...]
    clauses: list[str] = field(default_factory=list)

    def when_matched_update(self, keep: tuple[str, ...] = (), only_if: Condition | None = None) -> Merge:
        """Update a matched row to the source row's values, but for the `keep` columns."""
        columns = [c for c in self.warehouse.columns(self.table).names if c not in keep]
        assignments = ", ".join(f"t.{quote(c)} = s.{quote(c)}" for c in columns)
        self.clauses.append(f"WHEN MATCHED{f' AND ({only_if.sql})' if only_if else ''} THEN UPDATE SET {assignments}")
        return self

    def when_not_matched_insert_all(self) -> Merge:
        columns = self.warehouse.columns(self.table).names
        names = ", ".join(quote(c) for c in columns)
        self.clauses.append(
            f"WHEN NOT MATCHED THEN INSERT ({names}) VALUES ({', '.join(f's.{quote(c)}' for c in columns)})"
        )
        return self

    def execute(self):
        """Run it, again when another writer commits first. Delta's row counts of the MERGE (a Row with
        num_affected_rows, num_inserted_rows, ...), or None when the session gives none."""
        wh = self.warehouse
        view = f"crag_merge_{uuid.uuid4().hex}"
        self.rows.createOrReplaceTempView(view)
        matched = " AND ".join(f"t.{quote(c)} = s.{quote(c)}" for c in self.on)
        statement = (
            f"MERGE INTO {wh.name(self.table)} AS t USING {quote(view)} AS s ON {matched} {' '.join(self.clauses)}"
        )
        try:
            result = _retried_on_conflict(lambda: wh.spark.sql(statement).collect())
        finally:
            wh.spark.catalog.dropTempView(view)
        return result[0] if result else None


# ------------------------------------------------------------------ the warehouse


class Warehouse:
    """crag's tables in one catalog schema, read and written through one Spark session."""

    def __init__(self, spark, location: str, tables: TablesConfig | None = None):
        tables = tables or TablesConfig()
        self.spark = spark
        self.location = location
        self._created: set[str] = set()  # the tables this object created (local folder): crag's columns
        if is_catalog_schema(location):
            self.folder = None
            self.catalog, self.schema = (part.strip("`") for part in location.split("."))
            ensure_schema(spark, self.catalog, self.schema, tables.create_schema)
        else:
            path = Path(location)
            if path.exists() and not path.is_dir():
                raise InputError(f"warehouse {location} is a file, not a folder")
            self.folder = path.resolve()
            self.catalog = self.schema = ""  # none: the tables are named by their paths

    def __repr__(self) -> str:
        return f"Warehouse({self.location!r})"

    # ------------------------------------------------------------------ names

    @property
    def namespace(self) -> str:
        """The catalog schema that holds the tables ("" for a local folder: its tables are its paths)."""
        return "" if self.folder is not None else f"{self.catalog}.{self.schema}"

    def name(self, table: str) -> str:
        """The table's quoted name: catalog.schema.table, or a local folder's delta.`path`."""
        if self.folder is not None:
            return f"delta.{quote(str(self.folder / table))}"
        return ".".join(quote(part) for part in (self.catalog, self.schema, table))

    def path(self, table: str) -> Path | None:
        """Where a local warehouse keeps a stored table's files (None for catalog-managed tables)."""
        return None if self.folder is None else self.folder / table

    @staticmethod
    def columns(table: str) -> pa.Schema:
        return schema.TABLES[table]

    # ------------------------------------------------------------------ reading

    def exists(self, table: str) -> bool:
        """Whether the table (a stored table, or a view's stored table) is there to read."""
        table = schema.VIEWS[table].stored if table in schema.VIEWS else table
        if self.folder is not None:  # the folder says
            return has_delta_log(self.folder / table)
        try:
            return self.spark.catalog.tableExists(self.name(table))
        except Exception as exc:
            # A session without that catalog reads catalog.schema.table as a namespace of its own catalog
            if "REQUIRES_SINGLE_PART_NAMESPACE" not in str(exc):
                raise
            raise InputError(
                f"warehouse {self.location} was read as catalog.schema (no folder of that name exists), and this "
                f"Spark session has no catalog {self.catalog!r}: for a local folder, give ./{self.location}"
            ) from None

    def load(self, table: str):
        """The whole table as a Spark DataFrame (a view: the rows each run shows); an empty one with the
        table's columns if it does not exist yet."""
        if table in schema.VIEWS:
            view = schema.VIEWS[table]
            if not (self.exists(view.stored) and self.exists("runs")):
                return self.empty(table)
            return self.spark.sql(view.sql(self.name))
        if not self.exists(table):
            return self.empty(table)
        return self.spark.table(self.name(table))

    def load_run(self, table: str, run_id: str):
        from pyspark.sql import functions as F

        return self.load(table).where(F.col("run_id") == F.lit(run_id))

    def load_generation(self, table: str, run_id: str, generation: str):
        """The rows of one generation of a run, shown or not (a run reads its own rows before its
        outcome shows them): of a stored table, or of a view (without its generation column)."""
        view = schema.VIEWS.get(table)
        if not self.exists(view.stored if view else table):
            return self.empty(table)
        rows = self.spark.sql(view.sql(self.name, shown=False)) if view else self.spark.table(self.name(table))
        rows = rows.where(in_generation(run_id, generation))
        return rows.drop("generation") if view else rows

    def empty(self, table: str):
        """No rows, the table's columns. Built from one row of nulls: Spark Connect cannot create a
        DataFrame from an empty Arrow table."""
        return self.spark.createDataFrame(pa.Table.from_pylist([{}], schema=self.columns(table))).limit(0)

    def frame(self, table: str, rows: pa.Table):
        """Driver-side rows (small: a run's row, metrics, a comparison) as a DataFrame of the table."""
        target = self.columns(table)
        return self.spark.createDataFrame(rows.select(target.names).cast(target))

    # ------------------------------------------------------------------ writing

    def append(self, table: str, df) -> None:
        """Add rows (the table is created first if need be)."""
        self._write(table, df, lambda writer: writer.append())

    def append_observed(self, table: str, df, aggregates: list) -> dict:
        """Add rows, and return `aggregates` (Columns) over them, computed by Spark while it writes
        them: no second pass over the rows. (A creation would report no observed values; tables are
        created empty before their first rows, see `ensure`.)"""
        from pyspark.sql import Observation

        observations: list = []

        def observed(frame):
            observations.append(Observation(f"crag_{uuid.uuid4().hex}"))  # one per attempt
            return frame.observe(observations[-1], *aggregates)

        self._write(table, df, lambda writer: writer.append(), prepare=observed)
        return observations[-1].get  # read once the write has succeeded: its values are there

    def replace(self, table: str, df, condition) -> None:
        """Atomically replace the rows matching `condition` (a Column) with `df`'s rows."""
        self._write(table, df, lambda writer: writer.overwrite(condition))

    def forget(self, table: str, condition) -> None:
        """Remove the rows matching `condition` (a Column), if the table is there."""
        if self.exists(table):
            self.replace(table, self.empty(table), condition)

    def merge(self, table: str, rows, on: tuple[str, ...] | None = None) -> Merge:
        """A MERGE of `rows` into `table` on `on` (default: the table's key), to build and execute."""
        return Merge(self, table, rows, on or schema.STORED[table].key)

    def _write(self, table: str, df, action, prepare=None) -> None:
        df = df.select(*self.columns(table).names)

        def write():
            if not self.ensure(table):
                return _AGAIN  # another writer is creating it: its first commit is not in yet
            action((prepare(df) if prepare else df).writeTo(self.name(table)))
            return None

        if _retried_on_conflict(write) is _AGAIN:
            raise CragError(f"table {self.name(table)} was being created by another writer and did not appear")

    # ------------------------------------------------------------------ creating and checking

    def ensure(self, table: str) -> bool:
        """Create the stored table, empty, if it does not exist (`exists` registers one that another
        process has created in a local folder since this session first looked). Rows are never written
        by the creation itself: a creation that loses a race to another writer can fail after Delta has
        committed its rows, and writing them again would store them twice (seen: three Spark Connect
        clients finalising at once). Of writers creating a table at once, one succeeds; the others'
        conflict is ignored. True when the table is there now; False when another writer's creation
        is still on its way."""
        if self.exists(table):
            return True
        try:
            self._create(table)
        except Exception as exc:
            if not is_conflict(exc):
                raise
            return self.exists(table)
        return True

    def _create(self, table: str) -> None:
        """A new, empty Delta table with the table's own columns (crag.schema's types and nullability).
        In a local folder, its first commit is written by delta-rs (milliseconds, where a CTAS is a
        Spark job); its rows are Spark's to write. In a catalog,
        an empty CTAS (not `catalog.createTable` with a schema: through Spark Connect that records
        string columns as `string collate UTF8_BINARY`, which delta-rs cannot read), and the views over
        the stored table are created with it."""
        path = self.path(table)
        if path is not None:
            from deltalake import CommitProperties, write_deltalake  # noqa: PLC0415  # only a local warehouse

            # No retry: delta-rs would commit a creation that lost the race as the table's next version
            # (seen: of six creators at once, two "created" the table, as its versions 0 and 1)
            empty = pa.Table.from_pylist([], schema=self.columns(table))
            write_deltalake(str(path), empty, mode="error", commit_properties=CommitProperties(max_commit_retries=0))
            self._created.add(table)
            return
        self.empty(table).writeTo(self.name(table)).using("delta").create()
        for name, view in schema.VIEWS.items():
            if table in (view.stored, "runs"):
                self.spark.sql(f"CREATE VIEW IF NOT EXISTS {self.name(name)} AS {view.sql(self.name)}")

    def prepare(self, tables: tuple[str, ...]) -> None:
        """Before a run's first write: each of its stored `tables` checked, in parallel, to hold crag's
        columns (created when missing), and no view's name taken by a table of another kind, so that
        the run writes to all its tables or to none of them."""
        with ThreadPoolExecutor(max_workers=len(tables) + 1, thread_name_prefix="crag-prepare") as pool:
            checks = [pool.submit(self._prepare_one, t) for t in tables]
            checks.append(pool.submit(self._check_views))
            for check in checks:
                check.result()

    def load_states(self, tables: tuple[str, ...]) -> None:
        """Delta's state of each of `tables` (those that exist) read now, on the caller's thread: the
        next write to a table otherwise rebuilds the state of its latest version from the log first. A
        run reads the tables it writes last while it answers. A count reads a table's state as a MERGE
        does; but a table without rows (a new one's) is counted without its state, which its first
        append then computed ("Compute snapshot for version 0"), so such a table's summary is read
        too (DESCRIBE DETAIL, for which Delta computes it). In a warm local session, a MERGE into
        `runs` after the claim took 0.76 s unread, 0.39 s counted; a first append to a new table 0.64
        s, 0.33 s counted, 0.21 s after DESCRIBE DETAIL (docs/performance.md). Best effort: a state
        not read here is read by the write."""
        for table in tables:
            try:
                if self.exists(table) and not self.spark.table(self.name(table)).count():
                    self.spark.sql(f"DESCRIBE DETAIL {self.name(table)}").collect()
            except Exception:  # noqa: PERF203  # the write reads it again, and says what is wrong
                log.debug("could not read the state of table %s", table, exc_info=True)

    def _prepare_one(self, table: str) -> None:
        if not self.ensure(table) or table in self._created:
            return  # this or another writer's creation: of crag's columns
        found = [(f.name, f.dataType.simpleString()) for f in self.spark.table(self.name(table)).schema]
        wanted = [(f.name, f.dataType.simpleString()) for f in self.empty(table).schema]
        if found != wanted:
            differing = sorted({n for n, _ in found} ^ {n for n, _ in wanted}) or [
                n for (n, t), (_, w) in zip(found, wanted) if t != w
            ]
            raise InputError(
                f"table {table} in warehouse {self.location} is not crag's {table} table (columns "
                f"{', '.join(differing[:5]) or 'in another order'} differ): it belongs to another program or "
                f"another version of crag; write to another warehouse, or move that table away"
            )

    def _check_views(self) -> None:
        """A view's name held by a stored table: the layout of crag before 0.3 (answers, grades, ... were
        tables), or another program's table."""
        for name in schema.VIEWS:
            path = self.path(name)
            if path is not None:
                taken = (path / "_delta_log").is_dir()
            else:
                found = [t for t in self.spark.catalog.listTables(f"{self.catalog}.{self.schema}") if t.name == name]
                taken = bool(found) and found[0].tableType != "VIEW"
            if taken:
                raise InputError(
                    f"warehouse {self.location} has a table named {name}, where crag shows a view of its "
                    f"stored rows (a warehouse written by crag before 0.3, or by another program): write to "
                    f"another warehouse"
                )
