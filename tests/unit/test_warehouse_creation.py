"""A local folder's tables, created by delta-rs without Spark: crag's columns, in exactly one first
commit however many writers create them at once."""

from __future__ import annotations

import threading

from deltalake import DeltaTable

from crag import schema
from crag.warehouse import Warehouse


def test_a_missing_table_is_created_empty_with_crags_columns(tmp_path):
    wh = Warehouse(None, str(tmp_path / "wh"))
    assert wh.ensure("inputs") and wh.exists("inputs")
    table = DeltaTable(str(tmp_path / "wh" / "inputs"))
    assert table.version() == 0 and table.to_pyarrow_table().num_rows == 0
    assert table.schema().to_arrow().names == schema.INPUTS.names
    assert wh.ensure("inputs") and DeltaTable(str(tmp_path / "wh" / "inputs")).version() == 0


def test_of_writers_creating_a_table_at_once_one_commits_its_creation(tmp_path):
    """Six runs into a new warehouse at once (threads, a Warehouse each): every one finds the table
    there, and its log holds one creation, not one per writer that lost the race."""
    location, found, errors = str(tmp_path / "wh"), [], []
    start = threading.Barrier(6)

    def create() -> None:
        wh = Warehouse(None, location)
        start.wait()
        try:
            found.append(wh.ensure("runs"))
        except Exception as exc:  # the assertion below shows it
            errors.append(repr(exc))

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and found == [True] * 6
    table = DeltaTable(f"{location}/runs")
    assert table.version() == 0, [c["operation"] for c in table.history()]
    assert table.schema().to_arrow().names == schema.RUNS.names


def test_prepare_creates_a_new_folders_tables_without_spark(tmp_path):
    """A new local warehouse's tables are created (and so not read back) by delta-rs: no Spark session
    is needed to prepare them."""
    wh, tables = Warehouse(None, str(tmp_path / "wh")), ("runs", "inputs", "results", "metric_values")
    wh.prepare(tables)
    for table in tables:
        assert DeltaTable(str(tmp_path / "wh" / table)).schema().to_arrow().names == schema.TABLES[table].names
