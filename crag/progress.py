"""Progress of a long run on stderr: questions done / total, the rate and the time left (tqdm).

On a terminal it is one bar, redrawn in place. Elsewhere (a log file, a Databricks job's driver log)
it is off, unless forced: then each `advance` writes one plain line, since a redrawn bar would fill a
log with carriage returns.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = _is_terminal(self.stream)
        self.enabled = self.interactive if enabled is None else enabled
        self.desc = desc
        self._clock = clock
        self._bar: _QuestionMeter | None = None
        self._total = self._done = self._initial = 0
        self._started_at = 0.0

    def start(self, total: int, done: int = 0) -> ProgressReporter:
        self.close()
        self._total, self._done, self._initial = total, done, done
        self._started_at = self._clock()
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

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            line = _QuestionMeter.format_meter(
                self._done,
                self._total,
                self._clock() - self._started_at,
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
