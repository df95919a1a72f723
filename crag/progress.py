"""Progress of a long run on stderr: questions done / total, the rate and the time left (tqdm).

On a terminal it is one bar, redrawn in place. Elsewhere (a log file, a Databricks job's driver log)
it is off, unless forced: then each `advance` writes one plain line, since a redrawn bar would fill a
log with carriage returns.

The bar moves while a batch is answered, not only when it commits: the Spark tasks write how many of
their questions they have answered into a folder the driver made (`LiveProgress`), which the driver
reads twice a second. That folder is seen by tasks that run where the driver does (local Spark, a
local Spark Connect server); tasks elsewhere (a cluster's workers) write nothing, and the bar moves
at each committed batch. The count a commit reports is exact; the tasks' counts are only ever ahead
of it by questions answered and not yet committed.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

_UNIT = " questions"
_BAR = "{desc}: {n_fmt}/{total_fmt}" + _UNIT + " |{bar}| {percentage:3.0f}% [{elapsed}<{remaining}, {rate_text}]"
_LINE = "{desc}: {n_fmt}/{total_fmt}" + _UNIT + " ({percentage:.0f}%), {rate_text}, {elapsed} elapsed, {remaining} left"


def _rate_text(rate: float | None) -> str:
    """tqdm's own rate text puts the unit after "s/" when it inverts a slow rate ("1.09s/ questions"),
    and without inverting shows a rate under 0.005 as 0.00."""
    if not rate:
        return "? questions/s"
    return f"{rate:.2f} questions/s" if rate >= 1 else f"{1 / rate:.2f} s/question"


class _QuestionMeter(tqdm):
    """tqdm whose format has `rate_text`: the rate as tqdm measures it (smoothed, or done / elapsed)."""

    @staticmethod
    def format_meter(n, total, elapsed, *args, rate=None, initial=0, **kwargs):
        measured = rate if rate else ((n - initial) / elapsed if elapsed else None)
        return tqdm.format_meter(
            n, total, elapsed, *args, rate=rate, initial=initial, rate_text=_rate_text(measured), **kwargs
        )


class ProgressReporter:
    """`start(total)`, then `advance(n)` as batches finish, then `close()` (or use it as a context
    manager). `enabled`: None follows whether `stream` is a terminal; True forces it on, False off.
    A resumed run passes the questions already answered as `start(total, done=...)`: the rate and the
    time left count only this run's work."""

    def __init__(
        self,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        desc: str = "crag",
        clock: Callable[[], float] = time.monotonic,
        line_every_s: float = 10.0,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.line_every_s = line_every_s  # off a terminal: a line at most this often (and the last one)
        self.interactive = _is_terminal(self.stream)
        self.enabled = self.interactive if enabled is None else enabled
        self.desc = desc
        self._clock = clock
        self._bar: _QuestionMeter | None = None
        self.total = self._done = self._initial = 0
        self._started_at = 0.0

    def start(self, total: int, done: int = 0) -> ProgressReporter:
        self.close()
        self.total, self._done, self._initial = total, done, done
        self._started_at = self._last_line = self._clock()
        if self.enabled and self.interactive:
            self._bar = _QuestionMeter(
                total=total,
                initial=done,
                file=self.stream,
                desc=self.desc,
                unit=_UNIT,
                bar_format=_BAR,
                dynamic_ncols=True,
                leave=True,
                mininterval=0.2,
            )
        return self

    def set(self, done: int) -> None:
        """Move to `done` questions done (never back)."""
        if done > self._done:
            self.advance(done - self._done)

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            now = self._clock()
            if now - self._last_line < self.line_every_s and self._done < self.total:
                return
            self._last_line = now
            line = _QuestionMeter.format_meter(
                self._done,
                self.total,
                now - self._started_at,
                prefix=self.desc,
                unit=_UNIT,
                bar_format=_LINE,
                initial=self._initial,
            )
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


log = logging.getLogger("crag")


class LiveProgress:
    """A run's bar, moved by the questions its tasks report as they answer them (`report_answered`) and
    by each batch's commit. `start` once the total is known; `batch` before a batch's tasks run;
    `committed` when a batch's rows are committed."""

    def __init__(self, reporter: ProgressReporter, every_s: float = 0.5):
        self.reporter = reporter
        self.path = tempfile.mkdtemp(prefix="crag-progress-")
        self._every_s = every_s
        self._committed = 0
        self._committed_batches: set[int] = set()
        self._started = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="crag-progress", daemon=True)

    def start(self, total: int, done: int) -> None:
        with self._lock:
            self._committed = done
            self.reporter.start(total, done)
        self._started.set()

    def batch(self, number: int) -> None:
        """Batch `number` is about to run (its tasks' files start at nothing)."""
        for stale in Path(self.path).glob(f"{number}-*"):
            stale.unlink(missing_ok=True)

    def committed(self, number: int, rows: int) -> None:
        with self._lock:
            self._committed += rows
            self._committed_batches.add(number)
            if self._started.is_set():
                self.reporter.set(self._committed)
        if not self.reporter.interactive:  # the bar says it on a terminal; a log line says it elsewhere
            log.info(
                "batch %d committed: %d of %d questions answered", number + 1, self._committed, self.reporter.total
            )

    def _answering(self) -> int:
        """The questions answered by the tasks of batches not yet committed, as they reported them."""
        found = 0
        for report in Path(self.path).iterdir():
            batch, _, _ = report.name.partition("-")
            if batch.isdigit() and int(batch) not in self._committed_batches:
                try:
                    found += int(report.read_text() or 0)
                except (OSError, ValueError):  # replaced while read: the next poll reads it
                    pass
        return found

    def _poll(self) -> None:
        while not self._stop.wait(self._every_s):
            if self._started.is_set():
                with self._lock:
                    self.reporter.set(self._committed + self._answering())

    def __enter__(self) -> LiveProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.reporter.close()
        shutil.rmtree(self.path, ignore_errors=True)


def report_answered(folder: str | None, batch: int, task: int, answered: int) -> None:
    """A Spark task's count of its batch's questions answered so far, for `LiveProgress` (nothing when
    the driver's folder is not on this machine)."""
    if not folder or not os.path.isdir(folder):
        return
    final = Path(folder) / f"{batch}-{task}"
    partial = final.with_name(f".{final.name}.{os.getpid()}")
    partial.write_text(str(answered))
    os.replace(partial, final)  # whole, never half-written


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A step after answering, logged with its time."""
    started = time.perf_counter()
    yield
    log.info("%s: %.1f s", name, time.perf_counter() - started)
