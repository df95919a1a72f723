"""A warm Spark: the JVM's first Delta commits are slow.

A new JVM spends seconds on its first MERGE, append and table creation (loading and compiling
Delta's code); a cluster that has run a job before has paid that. `crag spark start` pays it once for
every command after it, and the benchmarks time a run after it and report its seconds apart, as they
report Spark's start-up. It touches no index and builds no backend, so nothing a run itself loads
(its indexes, its clients) is warmed for it.
"""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from crag import schema
from crag.config import CragConfig, SparkConfig
from crag.ledger import Ledger
from crag.spark import parallelism
from crag.warehouse import Warehouse


def warm_up(spark, folder: Path) -> float:
    """The Delta operations a run makes, once each, on a scratch warehouse; the seconds they took."""
    t0 = time.perf_counter()
    wh = Warehouse(spark, str(folder))
    wh.prepare(("runs", "inputs", "results", "metric_values"))  # creations and their checks
    first = Ledger(wh, CragConfig(), "warm-up", "base")
    first.claim()  # an insert-only MERGE
    row = {name: None for name in schema.INPUTS.names} | {"run_id": "warm-up", "generation": first.generation}
    inputs = wh.frame("inputs", pa.Table.from_pylist([row], schema=schema.INPUTS))
    wh.append("inputs", inputs)
    wh.append("inputs", inputs)
    first.record("succeeded", finished=datetime.now(UTC), show=True)  # a MERGE that updates
    again = Ledger(wh, CragConfig(), "warm-up", "base")
    again.claim(first.read())  # a MERGE that updates a finished run
    wh.load_run("rejects", "warm-up").count()
    shutil.rmtree(folder, ignore_errors=True)
    _warm_workers(spark)
    return time.perf_counter() - t0


def _warm_workers(spark) -> None:
    """A Python worker per task slot, each with crag's stage modules imported (Spark reuses its
    workers: a run's tasks find them loaded)."""
    slots = parallelism(spark, SparkConfig()) + 1

    def load(batches):
        import crag.spark  # noqa: F401, PLC0415  # what every task of a run imports

        time.sleep(0.2)  # hold the slot, so that every slot starts a worker of its own
        yield from batches

    spark.range(slots, numPartitions=slots).mapInArrow(load, "id long").collect()
