"""A warm Spark: the JVM's first Delta commits, and its first plan of a run's question checks, are slow.

A new JVM spends seconds on its first MERGE, append and table creation (loading and compiling
Delta's code); a cluster that has run a job before has paid that. `crag spark start` pays it once for
every command after it, and the benchmarks time a run after it and report its seconds apart, as they
report Spark's start-up. It touches no index and builds no backend, so nothing a run itself loads
(its indexes, its clients) is warmed for it.

The same operations, run once by `make install` (`python -m crag.spark_warm`), write the class-data
archive every later local JVM starts from (crag.spark.class_archive).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from crag import schema
from crag.batches import input_rows, input_totals
from crag.config import CragConfig, SparkConfig
from crag.errors import CragError
from crag.ledger import Ledger
from crag.questions import checked_input
from crag.spark import QUIET_ARCHIVE, class_archive, java_options, new_session, parallelism
from crag.warehouse import Warehouse


def warm_up(spark, folder: Path) -> float:
    """The Delta operations a run makes, once each, and its check of a question file, on a scratch
    warehouse; the seconds they took."""
    t0 = time.perf_counter()
    wh = Warehouse(spark, str(folder))
    wh.prepare(("runs", "inputs", "results", "metric_values"))  # creations and their checks
    first = Ledger(wh, CragConfig(), "warm-up", "base")
    first.claim()  # an insert-only MERGE
    _store_checked_questions(spark, wh, first, folder)  # a run's first query plans: its input read and checked
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


def _store_checked_questions(spark, wh: Warehouse, ledger: Ledger, folder: Path) -> None:
    """A question file read, checked and stored as a run's input is (crag.batches.store_input): a
    JVM's first plan of the checks took a run 1.1 s, where later ones take 0.2 s."""
    questions = folder / "questions.jsonl"
    questions.write_text('{"question_id": "q1", "question": "Which river?"}\n', encoding="utf-8")
    checked = checked_input(spark, str(questions), 100, parallelism(spark, SparkConfig()))
    wh.append_observed("inputs", input_rows(checked, ledger), input_totals())


def _warm_workers(spark) -> None:
    """A Python worker per task slot of a batch (crag.spark.parallelism), each with crag's stage modules
    imported (Spark reuses its workers: a run's tasks find them loaded). Not one for the slot left to
    the run's commits: Spark hands its idle workers out in turn, so that one would take batches too and
    load the indexes once more (half a gigabyte at bench/scale.py's size)."""
    slots = parallelism(spark, SparkConfig())

    def load(batches):
        import crag.spark  # noqa: F401, PLC0415  # what every task of a run imports

        time.sleep(0.2)  # hold the slot, so that every slot starts a worker of its own
        yield from batches

    spark.range(slots, numPartitions=slots).mapInArrow(load, "id long").collect()


def write_class_archive(cfg: SparkConfig, timeout_s: float = 600) -> Path | None:
    """The class-data archive of the classes a run's JVM loads (`warm_up`'s operations), or None when
    there is one already. A process of its own runs them: its JVM writes the archive as it exits, when
    that process ends. Written under a name of its own and renamed when whole, so that no JVM maps
    half an archive."""
    archive = class_archive(cfg)
    if archive.exists():
        return None
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
    command = [sys.executable, "-m", "crag.spark_warm", str(partial), cfg.jars_dir or ""]
    # its own process group: the JVM is in it, and the group is empty once the JVM has written and exited
    writer = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while writer.poll() is None or _group_alive(writer.pid):
            if time.monotonic() > deadline:
                raise CragError(f"the local JVM did not write its class-data archive within {timeout_s:g} s")
            time.sleep(0.2)
        if writer.returncode != 0:
            raise CragError(f"writing the local JVM's class-data archive failed (exit code {writer.returncode})")
        if not partial.exists():
            if archive.exists():  # another `make install` wrote it meanwhile
                return None
            raise CragError("the local JVM wrote no class-data archive")
        partial.replace(archive)
    finally:
        _end_group(writer.pid)
        partial.unlink(missing_ok=True)
    return archive


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _end_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _archive_classes(partial: str, jars_dir: str) -> None:
    """write_class_archive's process: a local JVM that archives the classes it loaded when it exits
    (its stdin closes when this process ends)."""
    cfg = SparkConfig(jars_dir=jars_dir or None)
    if class_archive(cfg).exists():  # written meanwhile; a JVM cannot start from one and write another
        return
    options = f"{java_options(cfg)} {QUIET_ARCHIVE} -XX:ArchiveClassesAtExit={partial}"
    spark = new_session(cfg, options)  # the classes it cannot archive (signed jars, ...) said to nobody
    with tempfile.TemporaryDirectory() as scratch:
        warm_up(spark, Path(scratch) / "warehouse")
    spark.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3:
        _archive_classes(*sys.argv[1:])
    elif not class_archive(SparkConfig()).exists():  # make install: quiet when the archive is there
        print(
            "crag: writing the local JVM's class-data archive into .crag/jars (once: about a minute)", file=sys.stderr
        )
        started = time.perf_counter()
        written = write_class_archive(SparkConfig())
        done = f"wrote {written}" if written else "another make install wrote it"
        print(f"crag: {done} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
