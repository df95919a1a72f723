"""The Warehouse's local folders: one session, several folders, each table's rows in its own folder."""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable

from crag import schema
from crag.warehouse import Warehouse


def _rejects(spark, wh: Warehouse, question_id: str):
    row = {name: None for name in schema.REJECTS.names} | {"run_id": "r", "question_id": question_id, "reason": "x"}
    return wh.frame("rejects", pa.Table.from_pylist([row], schema=schema.REJECTS))


def test_two_folders_used_in_turn_by_one_session_keep_their_own_rows(spark, tmp_path):
    first, second = Warehouse(spark, str(tmp_path / "a")), Warehouse(spark, str(tmp_path / "b"))
    first.append("rejects", _rejects(spark, first, "a1"))
    second.append("rejects", _rejects(spark, second, "b1"))  # the session's name now points at b
    first.append("rejects", _rejects(spark, first, "a2"))  # ... and must point at a again
    second.append("rejects", _rejects(spark, second, "b2"))
    for folder, expected in (("a", ["a1", "a2"]), ("b", ["b1", "b2"])):
        rows = DeltaTable(str(tmp_path / folder / "rejects")).to_pyarrow_table(columns=["question_id"])
        assert sorted(rows.column("question_id").to_pylist()) == expected, folder
    assert sorted(r["question_id"] for r in first.load("rejects").collect()) == ["a1", "a2"]
