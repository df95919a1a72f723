"""A warm cluster for the benchmarks: the JVM's first Delta commits are slow.

A new JVM spends seconds on its first MERGE, append and table creation (loading and
compiling Delta's code); a cluster that has run a job before has paid that. The benchmarks time a run
after this warm-up and report its seconds apart, as they report Spark's start-up. It touches no index
and starts no Python worker, so nothing a run itself loads is warmed for it.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from crag import schema
from crag.config import CragConfig
from crag.job import RunPlan, claim_run
from crag.warehouse import Warehouse


def warm_up_delta(spark, folder: Path) -> float:
    """The Delta operations a run makes, once each, on a scratch warehouse; the seconds they took."""
    t0 = time.perf_counter()
    wh = Warehouse(spark, str(folder))
    plan = RunPlan(CragConfig(), "warm-up", "base", wh, {}, uuid.uuid4().hex, datetime.now(UTC))
    claim_run(plan)  # creates `runs`, then an insert-only MERGE
    plan.record("succeeded")  # a MERGE that updates
    again = RunPlan(CragConfig(), "warm-up", "base", wh, {}, uuid.uuid4().hex, datetime.now(UTC))
    claim_run(again)  # an insert-only MERGE that inserts nothing, then one that updates
    row = {name: None for name in schema.REJECTS.names} | {"run_id": "warm-up", "question_id": "q", "reason": "-"}
    rejects = wh.frame("rejects", pa.Table.from_pylist([row], schema=schema.REJECTS))
    wh.append("rejects", rejects)  # creation, then an append
    wh.append("rejects", rejects)
    wh.load_run("rejects", "warm-up").count()
    for table in ("rejects", "runs"):
        wh.drop(table)
    return time.perf_counter() - t0
