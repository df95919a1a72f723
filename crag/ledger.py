"""A run's record in `runs`, and the one process that may write the run: its lease.

One `Ledger` per attempt at a run id. `claim` makes the attempt the run's only writer (a MERGE into
`runs`: Delta lets only one of two concurrent MERGEs commit), `heartbeat` keeps it so while a long
step runs, `check_held` proves it before the run's rows are written, and `record` writes the run's
status, counts and outcome only while the run is still this attempt's. A process that another took
over (it looked stale: no heartbeat for tables.stale_run_after_s) writes nothing more: RunTakenOver.

Each `crag run` of a run id writes a new generation of its rows; `--resume` continues the generation
it resumes. The outcome that succeeds shows the generation (runs.shown_generation): the views show
its rows from that commit on, and the earlier generation's rows until then.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa

from crag import schema
from crag.backends.remote import call_with_deadline
from crag.config import ConfigDifference, CragConfig, redacted
from crag.errors import CragError, describe, interrupt_in
from crag.secrets import scrub
from crag.warehouse import Warehouse, is_conflict, target_differs, target_matches

log = logging.getLogger("crag")


class RunTakenOver(CragError):
    """The run is no longer this attempt's: another process claimed it after this one looked stale."""


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Ledger:
    """The record of one attempt at a run id."""

    warehouse: Warehouse
    cfg: CragConfig
    run_id: str
    variant: str
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex)
    generation: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    input_hash: str = ""
    held_at: float = 0.0  # time.monotonic() of the last write that found the run this attempt's

    # ------------------------------------------------------------------ the row

    def row(
        self, status: str, counts: dict[str, int] | None = None, finished: datetime | None = None, shown: bool = False
    ) -> pa.Table:
        """The run's row as this attempt writes it: `shown`, the views show this attempt's generation
        (otherwise none, or, where the row is updated, the one they showed: see `record`)."""
        config = json.dumps(redacted(self.cfg.model_dump(mode="json")), sort_keys=True, ensure_ascii=False)
        return pa.Table.from_pylist(
            [
                {
                    "run_id": self.run_id,
                    "variant": self.variant,
                    "config": config,
                    "config_hash": self.cfg.hash(),
                    "started_at": self.started,
                    "finished_at": finished,
                    "status": status,
                    "counts": list((counts or {}).items()),
                    "attempt": self.attempt,
                    "owner": owner(),
                    "heartbeat_at": datetime.now(UTC),
                    "input_hash": self.input_hash,
                    "generation": self.generation,
                    "shown_generation": self.generation if shown else None,
                }
            ],
            schema=schema.RUNS,
        )

    def read(self):
        """The run's row in `runs`, or None."""
        rows = self.warehouse.load_run("runs", self.run_id).collect()
        return rows[0] if rows else None

    # ------------------------------------------------------------------ claiming

    def claim(self, previous=None, resume: bool = False) -> bool:
        """Make this attempt the run's only writer: a MERGE into `runs` that inserts the run, or takes
        over one that is not running (or whose writer is gone). The MERGE says how many rows it changed:
        one means the run is this attempt's; none, that the run id is not new, or another process got
        there first, and only then is the run's row read. `previous`: the run's row, if read already
        (None: the id is taken to be new, which a new run's id nearly always is). `resume`: take over
        only this attempt's generation of the run, failed or left by a writer that is gone, never a run
        that has succeeded since (`resumable` read it). True when the MERGE inserted the run."""
        for _ in range(10):
            takeover = None
            if resume and previous is not None and previous["status"] == "succeeded":
                raise CragError(f"run {self.run_id!r} has already succeeded: nothing to resume")
            if resume and previous is not None and previous["generation"] != self.generation:
                raise CragError(
                    f"run {self.run_id!r} was started again while this process read it: resume that run instead"
                )
            if previous is not None and previous["status"] == "running" and previous["attempt"] != self.attempt:
                if not _writer_gone(previous, self.cfg.tables.stale_run_after_s):
                    raise CragError(
                        f"run {self.run_id!r} is being written by another crag process ({previous['owner']}, last "
                        f"heartbeat {previous['heartbeat_at']:%Y-%m-%d %H:%M:%S} UTC): wait for it to end, or resume "
                        f"it after it stops (crag run --resume {self.run_id})"
                    )
                takeover = previous["attempt"]
            try:
                inserted = self._merge_claim(takeover, previous is None, resume)
                if inserted is not None:
                    self.held_at = time.monotonic()
                    return inserted
            except Exception as exc:
                if not is_conflict(exc):
                    raise
            previous = self.read()
            if previous is not None and previous["attempt"] == self.attempt:  # committed, though no reply said so
                self.held_at = time.monotonic()
                return False  # new or not, unknown: either way the run's generation is this attempt's
            time.sleep(0.2)
        raise CragError(f"could not claim run {self.run_id!r}: the runs table kept changing under this process")

    def _merge_claim(self, takeover: str | None, new_run: bool, resume: bool) -> bool | None:
        """Whether the run id was new (the MERGE inserted it) when this attempt now holds the run; None
        when it does not. A run id taken to be new is claimed by an insert-only MERGE (one join, no file
        rewritten); otherwise the MERGE also updates a run that is not running (or is `takeover`'s),
        keeping the generation it shows; a resume, only a failed or taken-over run of its generation."""
        wh = self.warehouse
        if not wh.ensure("runs"):  # another process is creating it: claim looks again shortly
            return None
        row = self.row("running")
        extra = {"takeover": takeover, "resumable": "failed"}  # values the conditions compare with
        for name, value in extra.items():
            row = row.append_column(name, pa.array([value], pa.string()))
        merge = wh.merge("runs", wh.spark.createDataFrame(row))
        if not new_run:
            free = target_differs("status") | target_matches("attempt", "takeover")
            if resume:
                free = (target_matches("status", "resumable") | target_matches("attempt", "takeover")) & target_matches(
                    "generation", "generation"
                )
            merge.when_matched_update(keep=("shown_generation",), only_if=free)
        result = merge.when_not_matched_insert_all().execute()
        # Delta's MERGE returns its row counts; without them, claim reads the run's row back
        if result is None or result["num_affected_rows"] != 1:
            return None
        if result["num_inserted_rows"]:
            return True
        return False

    def resumable(self):
        """The run's row, for `--resume`: it must exist, match the config and be unfinished. The attempt
        adopts the generation it resumes, and the input hash it was started with."""
        previous = self.read()
        if previous is None:
            raise CragError(f"no run {self.run_id!r} to resume in {self.warehouse.location}")
        if previous["config_hash"] != self.cfg.hash() or previous["variant"] != self.variant:
            raise CragError(
                f"run {self.run_id!r} was started with config {previous['config_hash']} (variant "
                f"{previous['variant']}); this one is {self.cfg.hash()} (variant {self.variant})"
                f"{self._differing_keys(previous)}: resume with the same --conf, --variant and --set"
            )
        if previous["status"] == "succeeded":
            raise CragError(f"run {self.run_id!r} has already succeeded: nothing to resume")
        if previous["generation"] is None:
            raise CragError(
                f"run {self.run_id!r} left no record of its input to resume from: start it again without --resume"
            )
        self.generation, self.started = previous["generation"], previous["started_at"]
        self.input_hash = previous["input_hash"] or ""
        return previous

    def _differing_keys(self, previous, shown: int = 5) -> str:
        """Which keys of the stored config differ from this one's, by name only, to keep the line short:
        ", differing in k1, k2". Nothing when only the variant's name differs (the line gives both)."""
        if previous["config_hash"] == self.cfg.hash():
            return ""
        difference = ConfigDifference.between(
            json.loads(previous["config"]),
            previous["config_hash"],
            redacted(self.cfg.model_dump(mode="json")),
            self.cfg.hash(),
        )
        if difference.masked:
            return ", differing in a value stored masked"  # a setting kept out of stored configs (a store's text_key)
        keys = difference.keys()
        more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
        return f", differing in {', '.join(keys[:shown])}{more}"

    # ------------------------------------------------------------------ holding

    def record(
        self, status: str, counts: dict[str, int] | None = None, finished: datetime | None = None, show: bool = False
    ) -> None:
        """The run's row rewritten, only while it is still this attempt's: a MERGE on the run id and
        this attempt. `show`: the outcome shows this attempt's generation. A process that found this one
        stale and took the run over has put its own attempt there; then nothing is written, and
        RunTakenOver says so."""
        wh = self.warehouse
        rows = wh.frame("runs", self.row(status, counts, finished, shown=show))
        keep = () if show else ("shown_generation",)
        result = wh.merge("runs", rows, on=("run_id", "attempt")).when_matched_update(keep=keep).execute()
        if result is None or result["num_affected_rows"] != 1:
            row = self.read()  # without row counts, the row read back says whether it was written
            if result is not None or row is None or (row["attempt"], row["status"]) != (self.attempt, status):
                raise self._taken_over(row)
        self.held_at = time.monotonic()

    def heartbeat(self) -> Heartbeat:
        """Beats that keep the run this attempt's while a long step runs, a third of the stale period
        after the last one ended; each records the run, then reads the state of `runs` on the beat's
        thread, rather than leaving that to the next write (the outcome's MERGE, after the last reply)."""
        return Heartbeat(self._beat, self.cfg.tables.stale_run_after_s / 3)

    def _beat(self) -> None:
        self.record("running")
        self.warehouse.load_states(("runs",))

    def check_held(self) -> None:
        """Before a step that writes the run's rows: when this attempt has not proven its hold on the
        run for half the stale period (a process paused, a beat that could not commit), another
        process may have taken the run over, so a beat is recorded now (RunTakenOver if so). Within
        that time no other process can have found the run stale: nothing is read or written."""
        if time.monotonic() - self.held_at <= self.cfg.tables.stale_run_after_s / 2:
            return
        try:
            self.record("running")
        except RunTakenOver:
            raise
        except Exception as exc:  # not written (a busy `runs` table): the row read back says whose the run is
            row = self.read()
            if row is None or row["attempt"] != self.attempt:
                raise self._taken_over(row) from None
            log.warning(
                "run %s: its hold could not be recorded (%s); it is still this process's", self.run_id, describe(exc)
            )

    def _taken_over(self, row) -> RunTakenOver:
        holder = f"{row['owner']}, attempt {row['attempt']}" if row is not None else "its row is gone"
        return RunTakenOver(
            f"run {self.run_id!r} was taken over by another crag process ({holder}) after this one looked "
            f"stale (no heartbeat for tables.stale_run_after_s): this process stops without writing more"
        )

    # ------------------------------------------------------------------ failing

    @contextmanager
    def failure_recorded(self) -> Iterator[None]:
        """Once the run is this attempt's, a failure (an exception, Ctrl-C, SIGTERM) is recorded as the
        run's `failed` status before it propagates: the run never stays `running` with no writer."""
        try:
            yield
        except BaseException as exc:
            self.record_failure(interrupted=interrupt_in(exc) is not None)
            raise

    def record_failure(self, interrupted: bool = False) -> None:
        """The run recorded as failed, the failure that ended it left to be reported. A Ctrl-C or SIGTERM
        (`interrupted`) can leave the calling thread's connection to the JVM in the middle of a call, where
        a new call can wait without end: the failure is then recorded from a thread of its own (a
        connection of its own) within a deadline. Otherwise a first attempt that fails is made again so."""

        def record() -> None:
            self.record("failed", finished=datetime.now(UTC))

        if not interrupted:
            try:
                record()
                return
            except RunTakenOver:
                return  # the run is another process's now: its row is that process's to write
            except Exception:
                log.debug("could not record the failed run from the calling thread", exc_info=True)
        try:
            call_with_deadline(record, 120, "recording the failed run")
        except RunTakenOver:
            return
        except Exception as exc:
            log.warning(
                "run %s could not be recorded as failed (%s): it shows as running until resumed",
                self.run_id,
                describe(exc),
            )


def _writer_gone(row, stale_after_s: float) -> bool:
    host, _, pid = (row["owner"] or "").rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    beat = row["heartbeat_at"]
    return beat is None or (datetime.now(UTC) - beat.replace(tzinfo=UTC)).total_seconds() > stale_after_s


class Heartbeat:
    """Calls `beat` every `every_s` seconds on a thread of its own, from `start` (once the run is held)
    until the block ends, so that a long batch never makes a live run look stale to another process
    (tables.stale_run_after_s), and the heartbeat's commit never stands between two batches. A failed
    beat is logged; the next one tries again. A beat that finds the run taken over (RunTakenOver) ends
    the beats, and the run with them: `check` raises it between batches, and so does the block's end."""

    def __init__(self, beat: Callable[[], None], every_s: float):
        self._beat, self._every_s = beat, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="crag-heartbeat", daemon=True)
        self.lost: RunTakenOver | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self._beat()
            except RunTakenOver as exc:
                self.lost = exc
                return
            except Exception as exc:  # the run goes on; a beat missed is a beat late
                log.warning("heartbeat not recorded (%s): the next one tries again", scrub(str(exc))[:200])

    def check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # a beat in progress ends before the run records its outcome
        if exc_type is None:
            self.check()
